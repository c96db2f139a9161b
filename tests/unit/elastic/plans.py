"""Model plans for the elastic unit tests: a service entry as the service file would give it
(the simulated engine unless told), with its GPUs per replica and GPU options."""

from __future__ import annotations

from typing import Any

from fabricnode.elastic.servicefile import ModelService
from fabricnode.elastic.vocab import ModelPlan


def plan(
    name: str,
    min_replicas: int = 1,
    max_replicas: int | None = None,
    gpus: int = 1,
    *,
    gpu_options: tuple[tuple[str, int], ...] = (),
    engine: str = "sim",
    **service: Any,
) -> ModelPlan:
    entry = ModelService(
        name=name,
        engine=engine,
        min_replicas=min_replicas,
        max_replicas=max(min_replicas, 1) if max_replicas is None else max_replicas,
        **service,
    )
    return ModelPlan(entry, gpus, gpu_options)
