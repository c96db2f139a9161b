"""What one replica of a model sustains (``ReplicaCapacity``), for the scaling policy.

From the placement planner when it knows the model and the GPU type (``planner_capacity``:
the analytic model's saturation rates, as ``bench/autoscale.py`` sizes its replicas), else
``DEFAULT_CAPACITY``, a deliberately low guess (docs/operators.md, "How the controller scales
above the minimum"): with it, a model the planner does not know scales out early rather than
late.

* Prefill: a replica doing only prefill runs full chunks of ``max_batched_tokens`` prompt
  tokens (of requests of the mean prompt length); its rate is the chunk's tokens over the
  chunk's step time.
* Decode: the analytic model's highest sustainable request rate for the workload's lengths
  leaves, per request, ``1/rate`` seconds of replica time; what the prompt's prefill does not
  take of it is the decode share, and the output tokens over that share the decode rate.
"""

from __future__ import annotations

from scheduler.analytic import max_rate
from scheduler.catalog import builtin_catalog
from scheduler.errors import SchedulerError
from scheduler.replica import ReplicaPerf
from scheduler.workload import LengthStats, Workload

from fabricnode.elastic.policy import ReplicaCapacity

# A replica of a model the planner does not know: about a 70B model on two A100-80G
# (planner: ~2,500 prompt and ~490 output tokens/s), rounded down.
DEFAULT_CAPACITY = ReplicaCapacity(prefill_tokens_per_s=2000.0, decode_tokens_per_s=400.0)

# The lengths the capacity is computed for: a typical chat request (plans.AUTO_*, the Azure
# conversation trace's means). The rates are per token, so they depend on lengths only weakly.
CHAT_INPUT_TOKENS = 1200
CHAT_OUTPUT_TOKENS = 200


def planner_capacity(perf: ReplicaPerf, lengths: LengthStats) -> ReplicaCapacity:
    """The planner's saturation rates of one replica for a workload's lengths (module
    docstring); ``SchedulerError`` when the analytic rate leaves no time to decode."""
    budget = perf.serving.max_batched_tokens
    prompts = budget / lengths.input_mean
    chunk_s = perf.step.time(budget, prompts, budget / 2, prompts * lengths.prefill_pairs)
    mu_p = budget / chunk_s
    rate = max_rate(perf, lengths)
    if rate <= 0:
        raise SchedulerError(f"{perf.name}: the model does not fit, no sustainable rate")
    decode_share = 1.0 / rate - lengths.input_mean / mu_p
    if decode_share <= 0:
        raise SchedulerError(f"{perf.name}: the analytic rate {rate:.2f} req/s is prefill-bound")
    return ReplicaCapacity(mu_p, lengths.output_mean / decode_share)


def catalog_capacity(model: str, gpu_type: str, gpus: int) -> ReplicaCapacity | None:
    """The planner's capacity of a replica of ``model`` (a catalog name, alias or a path with
    a config.json) on ``gpus`` GPUs of ``gpu_type``, for chat lengths; None when the planner
    does not know the model or the GPU type, or the model does not fit."""
    catalog = builtin_catalog()
    try:
        spec = catalog.model(model)
        gpu = catalog.gpu(gpu_type)
        lengths = Workload(spec.name, 1.0, CHAT_INPUT_TOKENS, CHAT_OUTPUT_TOKENS).lengths(
            spec.max_context
        )
        return planner_capacity(ReplicaPerf(spec, gpu, max(1, gpus)), lengths)
    except (SchedulerError, ValueError, ZeroDivisionError):
        return None
