"""Roofline cost of one engine iteration of one replica: a model on ``tp`` GPUs of one type.

Pure: numbers in, numbers out. Formulas, with the notation of docs/scheduler.md:

* Every operator of the model is listed with its FLOPs and the bytes it moves *per GPU* of the
  tensor-parallel group (Megatron sharding: q/o, MLP, experts and the vocabulary split ``tp``
  ways; k/v heads split too, replicated when ``tp`` exceeds their number).
* An operator takes ``max(FLOPs / (peak * compute_eff), bytes / (bandwidth * bandwidth_eff))``.
  The step takes the sum over operators, plus two ring all-reduces of the hidden state per layer
  (one more for the vocabulary-parallel embedding) and the logits all-gather over the link when
  ``tp > 1``, plus a fixed per-step overhead (scheduling, sampling, launch gaps).
* A step is described by four aggregates (``Batch``): new tokens, logit rows, KV tokens read and
  causal (query, key) pairs, so one continuous-batching iteration that mixes prefill chunks and
  decodes costs the same as the sum of its parts would, minus the weight reads it shares.
* Attention reads K and V once per *KV head* (GQA / MQA): ``kv_read * 2 * kv_heads_per_gpu *
  head_dim * kv_bytes``. LLM-Viewer's flash-decode counts them per attention head, which
  overstates GQA models' decode cost by ``heads / kv_heads`` (8x on Llama-3-70B); not here.
* Weights of the transformer blocks are read at the model's own ``weight_bits`` (a quantized
  checkpoint's width, ``ModelSpec.weight_bits``) or, when its catalog entry gives none, at the
  planner-wide ``RooflineConfig.weight_bits`` (weight-only quantization dequantizes into 16-bit
  GEMMs, so compute peaks do not change); embeddings and lm_head stay 16-bit, as AWQ/GPTQ
  checkpoints keep them. The KV cache is stored at ``kv_bits``.
* A MoE layer reads the weights of the distinct experts a step's tokens touch, expected
  ``E * (1 - (1 - k/E) ** tokens)`` with uniform routing, and computes ``k`` experts per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler.catalog import GIB, GpuSpec, ModelSpec
from scheduler.errors import CatalogError


@dataclass(frozen=True)
class RooflineConfig:
    """Precision, efficiency knobs and memory budget. A GPU's catalog entry overrides the two
    efficiencies for its type (calibration, docs/scheduler.md)."""

    weight_bits: int = 16
    kv_bits: int = 16
    activation_bits: int = 16
    compute_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    link_efficiency: float = 0.7
    step_overhead_s: float = 0.00085
    memory_utilization: float = 0.9
    reserve_gb: float = 1.5

    def __post_init__(self) -> None:
        for name in ("weight_bits", "kv_bits", "activation_bits"):
            if getattr(self, name) not in (4, 8, 16, 32):
                raise ValueError(f"{name} must be 4, 8, 16 or 32")
        for name in (
            "compute_efficiency",
            "bandwidth_efficiency",
            "link_efficiency",
            "memory_utilization",
        ):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")
        if self.step_overhead_s < 0 or self.reserve_gb < 0:
            raise ValueError("step_overhead_s and reserve_gb must not be negative")


@dataclass(frozen=True)
class Batch:
    """The work of one engine iteration (aggregates over its sequences).

    ``tokens``: new tokens run through the layers (1 per decoding sequence plus prefill chunk
    tokens); ``logits``: rows through lm_head (sequences that emit a token in this step);
    ``kv_read``: KV-cache tokens attention reads (each sequence's context including this step's
    tokens); ``attn_pairs``: causal (query, key) pairs attention computes.
    """

    tokens: float
    logits: float
    kv_read: float
    attn_pairs: float

    @staticmethod
    def decode(batch: int, context: float) -> Batch:
        """``batch`` sequences generating one token each after ``context`` cached tokens."""
        kv = batch * (context + 1)
        return Batch(batch, batch, kv, kv)

    @staticmethod
    def prefill(batch: int, prompt: int, cached: int = 0) -> Batch:
        """``batch`` prompts of ``prompt`` new tokens after ``cached`` tokens (a chunk)."""
        pairs = prompt * cached + prompt * (prompt + 1) / 2
        return Batch(batch * prompt, batch, batch * (cached + prompt), batch * pairs)

    def __add__(self, other: Batch) -> Batch:
        return Batch(
            self.tokens + other.tokens,
            self.logits + other.logits,
            self.kv_read + other.kv_read,
            self.attn_pairs + other.attn_pairs,
        )


@dataclass(frozen=True)
class OpCost:
    """One operator summed over the layers, per GPU: what it costs and what bounds it."""

    name: str
    flops: float
    bytes: float
    time_s: float
    bound: str  # "compute", "memory", "link" or "overhead"


@dataclass(frozen=True)
class _Op:
    """An operator whose work scales with tokens (or logit rows): flops and bytes per unit, plus
    bytes read once per step (weights). Totals over all layers, per GPU."""

    name: str
    per_logit: bool
    flops_per_unit: float
    fixed_bytes: float
    bytes_per_unit: float


@dataclass(frozen=True)
class MemoryFit:
    """Memory of one replica: weights and KV bytes per GPU, and KV tokens it can hold."""

    weight_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    usable_bytes_per_gpu: float
    kv_capacity_tokens: int

    @property
    def weights_fit(self) -> bool:
        return self.kv_capacity_tokens > 0

    def holds(self, tokens: float) -> bool:
        """Whether ``tokens`` KV tokens (e.g. target concurrency x sequence length) fit."""
        return self.kv_capacity_tokens >= tokens


def kv_heads_per_gpu(model: ModelSpec, tp: int) -> int:
    """KV heads each GPU holds: split ``tp`` ways, or one each (replicated) past that."""
    return max(1, model.kv_heads // tp)


def check_tp(model: ModelSpec, tp: int) -> str | None:
    """Why ``model`` cannot be sharded ``tp`` ways (None if it can)."""
    if tp < 1 or tp & (tp - 1):
        return f"tensor parallelism must be a power of two, got {tp}"
    if model.heads % tp:
        return f"{model.name}: {model.heads} attention heads do not split {tp} ways"
    if model.kv_heads % tp and tp % model.kv_heads:
        return f"{model.name}: {model.kv_heads} KV heads do not split {tp} ways"
    return None


def weight_bytes(model: ModelSpec, cfg: RooflineConfig) -> float:
    """Bytes per weight of the transformer blocks: the model's own width, else the config's."""
    return (model.weight_bits or cfg.weight_bits) / 8


def memory_fit(model: ModelSpec, gpu: GpuSpec, tp: int, cfg: RooflineConfig) -> MemoryFit:
    """Weights and KV cache of ``model`` on ``tp`` GPUs of type ``gpu``."""
    wb = weight_bytes(model, cfg)
    d = model.head_dim
    nkv = kv_heads_per_gpu(model, tp)
    qo = 2 * model.hidden * model.heads * d / tp
    kv = 2 * model.hidden * nkv * d
    mlp = model.mlp_params_per_layer / tp
    layers = model.layers * (qo + kv + mlp) * wb
    embeddings = model.embedding_params / tp * 2.0  # kept 16-bit
    weights = layers + embeddings
    kv_token = 2.0 * model.layers * nkv * d * cfg.kv_bits / 8
    usable = gpu.memory_bytes * cfg.memory_utilization - cfg.reserve_gb * GIB
    free = usable - weights
    capacity = int(free // kv_token) if free > 0 else 0
    return MemoryFit(weights, kv_token, usable, capacity)


class StepModel:
    """The roofline of one replica, compiled: ``time`` costs a few microseconds, so the
    discrete-event simulator calls it once per engine iteration."""

    def __init__(self, model: ModelSpec, gpu: GpuSpec, tp: int, cfg: RooflineConfig) -> None:
        problem = check_tp(model, tp)
        if problem:
            raise CatalogError(problem)
        self.model = model
        self.gpu = gpu
        self.tp = tp
        self.cfg = cfg
        ce = gpu.compute_efficiency or cfg.compute_efficiency
        be = gpu.bandwidth_efficiency or cfg.bandwidth_efficiency
        self.flops_per_s = gpu.peak_flops * ce
        self.bytes_per_s = gpu.memory_bw_bytes_s * be
        self.link_bytes_per_s = gpu.link_bw_bytes_s * cfg.link_efficiency
        self._build_ops()
        self._compile()

    # -- the operator list --------------------------------------------------------------------

    def _build_ops(self) -> None:
        m, tp, cfg = self.model, self.tp, self.cfg
        ab, wb, kb = cfg.activation_bits / 8, weight_bytes(m, cfg), cfg.kv_bits / 8
        h, d, n_layers = m.hidden, m.head_dim, m.layers
        nq = m.heads // tp
        nkv = kv_heads_per_gpu(m, tp)
        self.kv_heads_per_gpu = nkv
        ops: list[_Op] = []

        def linear(name: str, n_in: float, n_out: float) -> None:
            ops.append(
                _Op(
                    name,
                    False,
                    2.0 * n_in * n_out * n_layers,
                    n_in * n_out * wb * n_layers,
                    (n_in + n_out) * ab * n_layers,
                )
            )

        linear("q_proj", h, nq * d)
        linear("k_proj", h, nkv * d)
        linear("v_proj", h, nkv * d)
        linear("o_proj", nq * d, h)
        if m.is_moe:
            ie = m.expert_intermediate / tp
            k = m.experts_per_token
            ops.append(
                _Op(
                    "router",
                    False,
                    2.0 * h * m.experts * n_layers,
                    h * m.experts * wb * n_layers,
                    (h + m.experts) * ab * n_layers,
                )
            )
            self._expert = _Op(
                "experts",
                False,
                k * 3 * 2.0 * h * ie * n_layers,
                3.0 * h * ie * wb * n_layers,  # per distinct expert touched
                k * (2 * h + 3 * ie) * ab * n_layers,
            )
            mlp_width = k * ie
            if m.shared_expert_intermediate:
                si = m.shared_expert_intermediate / tp
                linear("shared_gate_proj", h, si)
                linear("shared_up_proj", h, si)
                linear("shared_down_proj", si, h)
                mlp_width += si
        else:
            inter = m.intermediate / tp
            linear("gate_proj", h, inter)
            linear("up_proj", h, inter)
            linear("down_proj", inter, h)
            mlp_width = inter
        # Fused add+RMSNorm twice (read x and residual, write both), SiLU*mul (read 2I, write I),
        # RoPE in place on q and k: memory-bound streams of activations.
        ops.append(
            _Op(
                "elementwise",
                False,
                (10.0 * h + 4.0 * mlp_width + 6.0 * (nq + nkv) * d) * n_layers,
                0.0,
                (8.0 * h + 3.0 * mlp_width + 2.0 * (nq + nkv) * d) * ab * n_layers,
            )
        )
        ops.append(_Op("embedding", False, 0.0, 0.0, 2.0 * h * ab))
        vocab = m.vocab / tp
        ops.append(_Op("lm_head", True, 2.0 * h * vocab, h * vocab * 2.0, (h + vocab) * ab))
        self._ops = ops
        # attention: FLOPs per (query, key) pair; bytes per KV token read and per new token.
        self._attn_flops_per_pair = 4.0 * nq * d * n_layers
        self._attn_bytes_per_kv = 2.0 * nkv * d * kb * n_layers
        self._attn_bytes_per_token = (2.0 * nq * d * ab + 2.0 * nkv * d * kb) * n_layers
        # communication: all-reduces of the hidden state per step; logits all-gather per row.
        self._allreduces = 2 * n_layers + 1
        self._allreduce_bytes_per_token = h * ab
        self._gather_bytes_per_logit = m.vocab * ab

    def _compile(self) -> None:
        f, b = self.flops_per_s, self.bytes_per_s
        self._tok = [
            (o.flops_per_unit / f, o.fixed_bytes / b, o.bytes_per_unit / b)
            for o in self._ops
            if not o.per_logit
        ]
        self._logit = [
            (o.flops_per_unit / f, o.fixed_bytes / b, o.bytes_per_unit / b)
            for o in self._ops
            if o.per_logit
        ]
        self._attn = (
            self._attn_flops_per_pair / f,
            self._attn_bytes_per_kv / b,
            self._attn_bytes_per_token / b,
        )
        self._moe = (0.0, 0.0, 0.0)
        self._moe_keep = 1.0
        if self.model.is_moe:
            e = self._expert
            self._moe = (e.flops_per_unit / f, e.fixed_bytes / b, e.bytes_per_unit / b)
            self._moe_keep = 1.0 - self.model.experts_per_token / self.model.experts
        tp = self.tp
        if tp > 1:
            alpha = self.gpu.link_latency_us * 1e-6
            beta = 2.0 * (tp - 1) / tp / self.link_bytes_per_s
            self._ar_fixed = self._allreduces * 2 * (tp - 1) * alpha
            self._ar_per_token = self._allreduces * beta * self._allreduce_bytes_per_token
            self._ag_fixed = (tp - 1) * alpha
            self._ag_per_logit = (
                (tp - 1) / tp * self._gather_bytes_per_logit / self.link_bytes_per_s
            )
        else:
            self._ar_fixed = self._ar_per_token = self._ag_fixed = self._ag_per_logit = 0.0

    def experts_touched(self, tokens: float) -> float:
        """Expected distinct experts per layer that ``tokens`` tokens route to."""
        if not self.model.is_moe:
            return 0.0
        return self.model.experts * (1.0 - math.pow(self._moe_keep, tokens))

    # -- costs --------------------------------------------------------------------------------

    def time(self, tokens: float, logits: float, kv_read: float, attn_pairs: float) -> float:
        """Seconds for one iteration (the ``Batch`` fields, unpacked for speed)."""
        if tokens <= 0:
            return 0.0
        total = self.cfg.step_overhead_s
        for a, w, c in self._tok:
            compute = a * tokens
            memory = w + c * tokens
            total += compute if compute > memory else memory
        for a, w, c in self._logit:
            compute = a * logits
            memory = w + c * logits
            total += compute if compute > memory else memory
        fa, ka, ta = self._attn
        compute = fa * attn_pairs
        memory = ka * kv_read + ta * tokens
        total += compute if compute > memory else memory
        if self.model.is_moe:
            a, w, c = self._moe
            compute = a * tokens
            memory = w * self.experts_touched(tokens) + c * tokens
            total += compute if compute > memory else memory
        if self.tp > 1:
            total += self._ar_fixed + self._ar_per_token * tokens
            total += self._ag_fixed + self._ag_per_logit * logits
        return total

    def step_time(self, batch: Batch) -> float:
        return self.time(batch.tokens, batch.logits, batch.kv_read, batch.attn_pairs)

    def ops(self, batch: Batch) -> list[OpCost]:
        """Per-operator breakdown of ``step_time(batch)`` (FLOPs and bytes per GPU)."""
        out: list[OpCost] = []

        def add(name: str, flops: float, nbytes: float) -> None:
            compute = flops / self.flops_per_s
            memory = nbytes / self.bytes_per_s
            bound = "compute" if compute > memory else "memory"
            out.append(OpCost(name, flops, nbytes, max(compute, memory), bound))

        for op in self._ops:
            units = batch.logits if op.per_logit else batch.tokens
            add(op.name, op.flops_per_unit * units, op.fixed_bytes + op.bytes_per_unit * units)
            if op.name == "o_proj":
                add(
                    "attention",
                    self._attn_flops_per_pair * batch.attn_pairs,
                    self._attn_bytes_per_kv * batch.kv_read
                    + self._attn_bytes_per_token * batch.tokens,
                )
            elif op.name == "router":
                e = self._expert
                add(
                    "experts",
                    e.flops_per_unit * batch.tokens,
                    e.fixed_bytes * self.experts_touched(batch.tokens)
                    + e.bytes_per_unit * batch.tokens,
                )
        if self.tp > 1:
            ar = self._ar_fixed + self._ar_per_token * batch.tokens
            ag = self._ag_fixed + self._ag_per_logit * batch.logits
            ar_bytes = self._allreduces * self._allreduce_bytes_per_token * batch.tokens
            out.append(OpCost("tp_allreduce", 0.0, ar_bytes, ar, "link"))
            ag_bytes = self._gather_bytes_per_logit * batch.logits
            out.append(OpCost("logits_allgather", 0.0, ag_bytes, ag, "link"))
        out.append(OpCost("step_overhead", 0.0, 0.0, self.cfg.step_overhead_s, "overhead"))
        return out

    def prefill_time(self, prompt: int, batch: int = 1) -> float:
        """One step prefilling ``batch`` prompts of ``prompt`` tokens from scratch."""
        return self.step_time(Batch.prefill(batch, prompt))

    def decode_time(self, batch: int, context: float) -> float:
        """One decode step of ``batch`` sequences with ``context`` cached tokens each."""
        return self.step_time(Batch.decode(batch, context))

    def request_latency(self, prompt: int, output: int, batch: int = 1) -> float:
        """End-to-end seconds for ``batch`` identical requests run together from an empty
        engine: one prefill step (yields the first token), then ``output - 1`` decode steps."""
        total = self.prefill_time(prompt, batch)
        for i in range(output - 1):
            total += self.decode_time(batch, prompt + i)
        return total
