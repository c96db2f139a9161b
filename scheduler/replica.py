"""One serving replica: a model on ``tp`` GPUs of one type, with its engine limits.

``ReplicaPerf`` bundles what both serving models need: the compiled roofline (``StepModel``), the
memory budget (``MemoryFit``) and the engine's batching limits (``ServingConfig``, vLLM's
``max_num_seqs`` and ``max_num_batched_tokens``). ``tp_options`` lists the tensor-parallel
degrees on which a model is memory-feasible for a workload (constraint C2 of the paper).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.catalog import GpuSpec, ModelSpec
from scheduler.roofline import MemoryFit, RooflineConfig, StepModel, check_tp, memory_fit
from scheduler.workload import LengthStats


@dataclass(frozen=True)
class ServingConfig:
    """Engine limits per replica and the C2 target concurrency.

    ``min_concurrency``: a replica is memory-feasible when its KV cache holds this many requests
    of the workload's mean length (and one of the longest, ``max_request_tokens``)."""

    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    min_concurrency: int = 8

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_batched_tokens < 2 or self.min_concurrency < 1:
            raise ValueError("max_num_seqs, max_batched_tokens and min_concurrency must be >= 1")


class ReplicaPerf:
    """Performance model of one replica (model, GPU type, TP degree)."""

    def __init__(
        self,
        model: ModelSpec,
        gpu: GpuSpec,
        tp: int,
        roofline: RooflineConfig | None = None,
        serving: ServingConfig | None = None,
    ) -> None:
        self.model = model
        self.gpu = gpu
        self.tp = tp
        self.roofline = roofline or RooflineConfig()
        self.serving = serving or ServingConfig()
        self.step = StepModel(model, gpu, tp, self.roofline)
        self.memory: MemoryFit = memory_fit(model, gpu, tp, self.roofline)

    @property
    def name(self) -> str:
        return f"{self.model.name} on {self.tp}x{self.gpu.name}"

    @property
    def kv_capacity_tokens(self) -> int:
        return self.memory.kv_capacity_tokens

    def slots(self, lengths: LengthStats) -> float:
        """Requests the replica can hold at once: KV reservations of mean length, and
        ``max_num_seqs``."""
        return min(float(self.serving.max_num_seqs), self.kv_capacity_tokens / lengths.kv_tokens)

    def infeasible_reason(self, lengths: LengthStats) -> str | None:
        """Why this replica cannot serve the workload (C2), or None."""
        if not self.memory.weights_fit:
            need = self.memory.weight_bytes_per_gpu / 2**30
            have = self.memory.usable_bytes_per_gpu / 2**30
            return f"{self.name}: weights need {need:.1f} GiB per GPU, {have:.1f} GiB usable"
        want = self.serving.min_concurrency * lengths.kv_tokens
        if not self.memory.holds(want):
            return (
                f"{self.name}: KV cache holds {self.kv_capacity_tokens} tokens, "
                f"{self.serving.min_concurrency} requests need {want:.0f}"
            )
        return None


def tp_options(
    model: ModelSpec,
    gpu: GpuSpec,
    lengths: LengthStats,
    roofline: RooflineConfig | None = None,
    serving: ServingConfig | None = None,
    max_tp: int | None = None,
) -> list[int]:
    """TP degrees (powers of two up to the GPU's ``gpus_per_node``, or ``max_tp``) that shard
    ``model`` evenly and are memory-feasible for ``lengths``; smallest first."""
    limit = gpu.gpus_per_node if max_tp is None else min(max_tp, gpu.gpus_per_node)
    options: list[int] = []
    tp = 1
    while tp <= limit:
        if check_tp(model, tp) is None:
            perf = ReplicaPerf(model, gpu, tp, roofline, serving)
            if perf.infeasible_reason(lengths) is None:
                options.append(tp)
        tp *= 2
    return options
