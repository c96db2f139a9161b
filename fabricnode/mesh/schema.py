"""The registry's schema: every label key the packages exchange through it, and the one verdict
on whether a node counts.

The registry is the bus between packages: the engine supervisor, the elastic controller, the
ingress and the host layer each write labels on their own node's signed entry, and other
packages read them from every entry. This module is where each key is spelled, once, with who
writes and who reads it; modules import the key from here, never from each other, so a reader
does not depend on its writer's package (the controller reads the engine's error without
importing the engine supervisor).

Labels
------
A label is a ``(key, value)`` pair of strings on a signed entry (``registry.EntryBody.labels``,
at most ``MAX_LABELS`` of them, values of at most ``MAX_LABEL_VALUE`` characters). Operators
add their own with ``fabric start --label K=V``; the keys below are the ones the fabric itself
reads. ``GossipService.relabel(prefix, labels)`` replaces every label whose key starts with
``prefix``: a key named as a prefix below covers its numbered or suffixed variants.

=============================  ==============================  ================================
key (value)                    written by                      read by
=============================  ==============================  ================================
``fabric.sleeping``            ``engine.sleep`` while its      ``dataplane.routetable`` (routed
(the sleep level)              engine sleeps                   to only when no awake replica),
                                                               ``control.views``, ``fabric
                                                               nodes``
``fabric.priority_scheduling`` ``engine.service`` when the     ``dataplane.routetable``: batch
(``"1"``)                      engine schedules by priority    requests carry a priority there
``fabric.parents``             ``engine.service`` through      ``model_parents`` (here):
(parent index per model)       ``parents_labels`` (here)       ``/v1/models``, ``control.views``
``fabric.engine_error``        ``engine.service`` as it goes   ``elastic.observe.replicas``:
(the engine's last words)      DOWN                            a failed start's status
``fabric.plan`` (plan id),     ``engine.follower`` acting on   ``fabric plan --apply``
``fabric.plan_status``         an assignment (one prefix)      (``cli.planning``)
``fabric.service`` (model)     ``elastic.slurmctl``: the       ``elastic.observe`` (the
                               ``--label`` of a submitted      controller's replicas, their
                               job's agent                     load and GPU type), ``fabric
                                                               services``
``fabric.wanted``,             ``agent`` (``elastic.demand.    ``elastic.observe.wanted_
``fabric.wanted.1`` ...        wanted_labels``) while its      held``: ``elastic.demand``
(``model=held`` items,         ingress holds requests for a    scales a declared model from
space-separated:               model with no replica (prefix;  zero, ``elastic.follow`` counts
``wanted_items``)              ``held_step`` counts)           the held in the backlog
``fabric.serving_since``       ``engine.service`` as its       ``elastic.observe.replicas``:
(unix time)                    session first serves            a job's start-up time, learned
                                                               also by a controller that took
                                                               over (``reconcile._learn``)
``fabric.controller``          ``agent`` with ``--controller`` ``elastic.observe.acting_
(unix time, candidate since)                                   controller`` (``elastic.leader``:
                                                               who acts); ``fabric services``
``fabric.job_end``             ``agent`` in a Slurm job        ``mesh.core``: the entry's lease
(unix time, the job's end)     (``host.lease.lease_label``)    never goes past it
``slurm.job_id``,              ``agent`` in a Slurm job        ``elastic.observe.replicas``
``slurm.partition``                                            (matches replicas to jobs),
                                                               ``fabric nodes --label``
``fabric.name`` (a name)       operators and ``LocalMesh``     people: ``fabric nodes``, the
                               (``fabric start --label``)      demo
``fabric.site`` (a site name)  ``registry.EntryBody`` on the   ``registry.parse_body``, into
                               wire, for ``EntryBody.site``    ``EntryBody.site``: never left
                               when not ``default``            among the labels (the key is
                                                               spelled in ``mesh.sites``)
=============================  ==============================  ================================

Standing
--------
Whether a node counts is joined from two things that live apart on purpose: its signed entry's
lifecycle state (what the owner says) and this node's local liveness view of the owner (SWIM:
a crashed node cannot sign its own death). ``standing`` is the one function that joins them;
``MeshCore.standing`` feeds it and ``MeshCore.entries(at_least)`` lists the entries of at least
a standing. The levels are ordered, each implies the ones below it:

* ``GONE``: signed DOWN (its engine stopped), or DEAD in this node's view. Nothing it accepted
  will be answered.
* ``LEAVING``: signed LEFT (or LEFT in the view): it takes nothing new but finishes what it
  accepted (the ingress does not fail over a request in flight to it).
* ``UNVOUCHED``: not known gone, but no probe vouches for it: its owner is not a member with a
  gossip address (not yet learned, or an entry no one can probe). The data plane never routes
  to it (an unprobed entry would count as alive for ever: a cluster-key holder could flood the
  registry with phantoms), and neither does the control plane (``CONTROL_COUNTS``).
* ``LIVE``: a probed member, alive or suspect, whose entry is not SERVING (JOIN).
* ``SUSPECT``: SERVING, probed, suspected: routed to only when no ``ROUTABLE`` node is left.
* ``ROUTABLE``: SERVING, probed and alive.

Who asks for what: the data plane routes to ``>= SUSPECT`` (``ROUTABLE`` first) and lists
models of ``>= SUSPECT`` nodes; the control plane (what the elastic controller and its scalers
read of the registry, ``elastic.observe``; the admin views) counts ``>= CONTROL_COUNTS``; a
request in flight is failed over only from a ``GONE`` node; a batch shard's holder is gone at
``<= LEAVING``.

The module is pure: no I/O, no clock, nothing but the mesh's own enums.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from fabricnode.mesh.membership import Liveness
from fabricnode.mesh.registry import EntryBody, ModelInfo, State

# -- label keys (the table above) ------------------------------------------------------------

# A SERVING node whose engine sleeps (value: the sleep level): not routed to while there is an
# awake replica of its models; a request for a model with none goes to it and wakes it.
SLEEPING_LABEL = "fabric.sleeping"
# A SERVING node whose engine serves waiting requests by their ``priority`` field (vLLM's
# ``--scheduling-policy priority``; value "1"): batch-tier requests routed to it carry a
# priority below the interactive ones', so under pressure the engine lets them wait first.
PRIORITY_SCHEDULING_LABEL = "fabric.priority_scheduling"
# Which models are adapters (LoRA) of which others on this entry: the model row has no room
# for a parent (every peer decodes exactly three fields), and a label is what older peers
# carry unchanged. Value: one item per model, in the entry's order, separated by commas: the
# index of the model's parent among the entry's models, or empty for a base model; so
# ``",0,0"`` says models 1 and 2 are adapters of model 0. At most 64 models of two digits each:
# never more than 191 characters. Set only on an entry that lists an adapter
# (``parents_labels`` writes it, ``model_parents`` reads it).
PARENTS_LABEL = "fabric.parents"
# The engine's own words as it went DOWN (at most MAX_LABEL_VALUE characters).
ENGINE_ERROR_LABEL = "fabric.engine_error"
# The operator's plan this JOIN-only node acts on, and how that went; PLAN_LABEL is also the
# relabel prefix that replaces both.
PLAN_LABEL = "fabric.plan"
PLAN_STATUS_LABEL = "fabric.plan_status"
# The declared model a controller-submitted job serves.
SERVICE_LABEL = "fabric.service"
# Models an ingress holds requests for with no replica, and how many (``wanted_items``,
# ``parse_wanted``); also WANTED_LABEL.1 ... (the prefix).
WANTED_LABEL = "fabric.wanted"
# When this session's engine first served (unix time): a job's start-up time, for the controller.
SERVING_SINCE_LABEL = "fabric.serving_since"
# A controller candidate, and since when (unix time).
CONTROLLER_LABEL = "fabric.controller"
# The end of the Slurm job the agent runs in (unix time): its lease never goes past it.
JOB_END_LABEL = "fabric.job_end"
SLURM_JOB_LABEL = "slurm.job_id"
SLURM_PARTITION_LABEL = "slurm.partition"
# A name for people (LocalMesh and the demo set it; nothing in the fabric reads it).
NAME_LABEL = "fabric.name"


# -- label values ---------------------------------------------------------------------------


def parents_labels(
    models: tuple[ModelInfo, ...], parents: dict[str, str]
) -> tuple[tuple[str, str], ...]:
    """The ``fabric.parents`` label saying which of ``models`` are adapters of which (from
    ``parents``: model id -> parent id); none when no model has a parent among ``models``."""
    index = {m.id: i for i, m in enumerate(models)}
    items = []
    for i, m in enumerate(models):
        p = index.get(parents.get(m.id, ""))
        items.append("" if p is None or p == i else str(p))
    return ((PARENTS_LABEL, ",".join(items)),) if any(items) else ()


def model_parents(body: EntryBody) -> dict[str, str]:
    """Model id -> the id of the model it is an adapter of, from the entry's
    ``fabric.parents`` label; an entry without one (or with one that does not match its
    models) has none."""
    value = next((v for k, v in body.labels if k == PARENTS_LABEL), None)
    if not value:
        return {}
    items = value.split(",")
    models = body.models
    if len(items) != len(models):
        return {}
    out = {}
    for i, item in enumerate(items):
        if 0 < len(item) <= 2 and item.isascii() and item.isdigit():
            p = int(item)
            if p < len(models) and p != i:
                out[models[i].id] = models[p].id
    return out


# What one ingress may say it holds for one model: a count above is read as this. An
# ingress holds at most ``IngressConfig.max_waiting_for_replica`` (1,024) in all.
MAX_WANTED_HELD = 100_000
_MAX_COUNT_DIGITS = 6


def held_step(n: int) -> int:
    """What a ``fabric.wanted`` label says of ``n`` requests held: ``n`` rounded down to 1, 2,
    3, 4, 6, 8, 12, 16, 24, ... (two steps an octave) and at most ``MAX_WANTED_HELD``, so the
    label (a signed entry, gossiped) changes a few times as a queue grows, not per request."""
    n = min(n, MAX_WANTED_HELD)
    if n <= 4:
        return max(0, n)
    p = 1 << (n.bit_length() - 1)
    return p + p // 2 if n >= p + p // 2 else p


def wanted_items(held: Mapping[str, int]) -> list[str]:
    """The items of ``fabric.wanted`` values for ``held`` (model -> requests held, models
    holding none left out), sorted: ``<model>=<count>``, the count by ``held_step``. A model id
    has no spaces (the service file's rule) but may hold ``=``: the count is after the last."""
    return [f"{m}={held_step(n)}" for m, n in sorted(held.items()) if n > 0]


def parse_wanted(value: str) -> dict[str, int]:
    """Model -> requests held, from one ``fabric.wanted`` value (peer input: read with care).
    An item is ``<model>=<count>``, the count 1 to 6 ASCII digits, clamped to 1 ..
    ``MAX_WANTED_HELD``; an item without one (a peer of the format before the counts, or one
    that does not parse) says the model is wanted, count 1. A model listed twice keeps its
    largest count."""
    out: dict[str, int] = {}
    for item in value.split():
        model, sep, count = item.rpartition("=")
        digits = 0 < len(count) <= _MAX_COUNT_DIGITS and count.isascii() and count.isdigit()
        if sep and model and digits:
            n = min(MAX_WANTED_HELD, max(1, int(count)))
            out[model] = max(out.get(model, 0), n)
            continue
        out[item] = max(out.get(item, 0), 1)
    return out


# -- standing ---------------------------------------------------------------------------------


class Standing(enum.IntEnum):
    """How far this node may rely on another (module docstring, "Standing"); ordered."""

    GONE = 0
    LEAVING = 1
    UNVOUCHED = 2
    LIVE = 3
    SUSPECT = 4
    ROUTABLE = 5

    @property
    def label(self) -> str:
        return self.name.lower()


# What the control plane (elastic.observe for the controller, its leader election and its
# scalers; the admin views and their fan-outs) counts: the same members the data plane trusts,
# probed and alive or suspect. An entry no probe vouches for could be any cluster-key holder's
# invention (a controller candidate that makes the real one stand by, a workload endpoint that
# reports invented demand): it counts for nothing until its owner answers probes.
CONTROL_COUNTS = Standing.LIVE


def standing(state: State, liveness: Liveness | None, *, probed: bool) -> Standing:
    """The standing of a node whose entry is in ``state``, given this node's view of its owner:
    ``liveness`` (None: not a member) and ``probed`` (a member with a gossip address, so SWIM
    probes it; ignored when ``liveness`` is None). What ends a node's usefulness wins: DOWN or
    DEAD over LEFT, LEFT over the rest."""
    if state is State.DOWN or liveness is Liveness.DEAD:
        return Standing.GONE
    if state is State.LEFT or liveness is Liveness.LEFT:
        return Standing.LEAVING
    if liveness is None or not probed:
        return Standing.UNVOUCHED
    if state is not State.SERVING:
        return Standing.LIVE
    return Standing.SUSPECT if liveness is Liveness.SUSPECT else Standing.ROUTABLE
