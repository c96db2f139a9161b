"""From the service file to what the controller acts on (``ModelPlan`` per declared model).

``gpus_per_replica = "auto"`` asks the placement planner (``scheduler``) for the smallest
tensor-parallel degree that holds the model on its first allowed GPU type with room for its KV
cache (``scheduler.replica.tp_options``, a typical chat workload's lengths), by node shape: the
TP stays within one node (the type's ``gpus_per_node``). A model the planner does not know (not
in the catalog, no config.json at its path) or without a GPU type gets one GPU per replica, and
the status says so.

``gres_types`` name the model's GPU types as Slurm knows them (``--gres=gpu:TYPE:N``), paired
with ``gpu_types`` in order: each Slurm type gets the GPUs per replica of its own GPU type
("auto" sizes each), and the controller tries them in that order (``ModelPlan.gpu_options``).
"""

from __future__ import annotations

from scheduler.catalog import builtin_catalog
from scheduler.errors import SchedulerError
from scheduler.replica import tp_options
from scheduler.workload import Workload

from fabricnode.elastic.servicefile import ModelService, ServiceSpec, parse
from fabricnode.elastic.vocab import ModelPlan, ServicePlans

# A typical chat request (the Azure conversation trace's means, rounded) for "auto" GPUs.
AUTO_INPUT_TOKENS = 1200
AUTO_OUTPUT_TOKENS = 200


def plans_from_text(text: str) -> ServicePlans:
    """The controller's plans of a service file; ``ServiceFileError`` if it is not valid."""
    return plans_of(parse(text, "the mesh's service file"))


def plans_of(spec: ServiceSpec) -> ServicePlans:
    return ServicePlans(tuple(plan_of(m) for m in spec.models), spec.limits, spec.digest())


def auto_gpus(model: ModelService, gpu_type: str | None = None) -> int:
    """GPUs per replica for ``gpus_per_replica = "auto"`` on ``gpu_type`` (default: the first
    allowed; module docstring)."""
    if model.simulated or not model.gpu_types:
        return 1
    catalog = builtin_catalog()
    try:
        spec = catalog.model(model.model_path or model.name)
        gpu = catalog.gpu(gpu_type or model.gpu_types[0])
    except SchedulerError:
        return 1
    lengths = Workload(spec.name, 1.0, AUTO_INPUT_TOKENS, AUTO_OUTPUT_TOKENS).lengths(
        spec.max_context
    )
    options = tp_options(spec, gpu, lengths)
    return options[0] if options else 1


def gpu_options(m: ModelService) -> tuple[tuple[str, int], ...]:
    """(Slurm GPU type, GPUs per replica) in order of preference; () = any type."""
    out = []
    for i, name in enumerate(m.gres_types):
        kind = m.gpu_types[i] if i < len(m.gpu_types) else None
        gpus = m.gpus_per_replica
        out.append((name, gpus if gpus is not None else auto_gpus(m, kind)))
    return tuple(out)


def plan_of(m: ModelService) -> ModelPlan:
    """The controller's plan of one declared model: the entry and its GPU options."""
    options = gpu_options(m)
    if options:
        gpus = options[0][1]
    else:
        gpus = m.gpus_per_replica if m.gpus_per_replica is not None else auto_gpus(m)
    return ModelPlan(m, gpus, options)
