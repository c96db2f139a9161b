"""Roofline: operator FLOPs and bytes against hand-computed values (dense Llama-2-7B, GQA
Llama-3 8B/70B, MoE Mixtral), quantization, tensor parallelism, memory feasibility, and the
RTX-3090 vs H100 calibration target of the paper."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.catalog import builtin_catalog
from scheduler.replica import ServingConfig, tp_options
from scheduler.roofline import Batch, OpCost, RooflineConfig, StepModel, check_tp, memory_fit
from scheduler.workload import Workload

CATALOG = builtin_catalog()
DEFAULT = RooflineConfig()
H100_BW = 3350e9 * 0.8  # bytes/s: datasheet x default bandwidth efficiency
H100_FLOPS = 989e12 * 0.5  # FLOP/s: datasheet x the catalog's Hopper compute efficiency


def step(model: str, gpu: str = "H100-SXM", tp: int = 1, **cfg: int) -> StepModel:
    return StepModel(CATALOG.model(model), CATALOG.gpu(gpu), tp, RooflineConfig(**cfg))


def op(ops: list[OpCost], name: str) -> OpCost:
    return next(o for o in ops if o.name == name)


def test_dense_decode_operators_match_hand_computed_flops_and_bytes() -> None:
    # Llama-2-7B: 32 layers, hidden 4096, 32 heads (MHA), head_dim 128, MLP 11008, vocab 32000.
    s = step("llama-2-7b")
    ops = s.ops(Batch.decode(1, 1023))  # one sequence, 1023 cached tokens + the new one
    q = op(ops, "q_proj")
    assert q.flops == 2 * 4096 * 4096 * 32  # 1,073,741,824
    assert q.bytes == 4096 * 4096 * 2 * 32 + (4096 + 4096) * 2 * 32  # weights + in/out
    assert q.bound == "memory"
    assert q.time_s == pytest.approx(1_074_266_112 / H100_BW)
    gate = op(ops, "gate_proj")
    assert gate.flops == 2 * 4096 * 11008 * 32
    assert gate.bytes == 4096 * 11008 * 2 * 32 + (4096 + 11008) * 2 * 32
    attn = op(ops, "attention")
    assert attn.flops == 4 * 1024 * 32 * 128 * 32  # QK^T and PV over 1024 keys, 32 heads
    # K and V of 1024 tokens for 32 KV heads, plus Q read, O write and the new token's K, V
    assert attn.bytes == 1024 * 2 * 32 * 128 * 2 * 32 + (2 * 32 * 128 * 2 + 2 * 32 * 128 * 2) * 32
    lm_head = op(ops, "lm_head")
    assert lm_head.flops == 2 * 4096 * 32000
    assert lm_head.bytes == 4096 * 32000 * 2 + (4096 + 32000) * 2
    # Every operator is memory-bound at batch 1: the step is bytes / bandwidth + overhead.
    assert sum(o.bytes for o in ops) == 13_762_419_200
    assert s.decode_time(1, 1023) == pytest.approx(13_762_419_200 / H100_BW + 0.00085)
    assert s.decode_time(1, 1023) == pytest.approx(sum(o.time_s for o in ops))


def test_dense_prefill_is_compute_bound_with_hand_computed_flops() -> None:
    s = step("llama-2-7b")
    ops = s.ops(Batch.prefill(1, 1000))
    linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # 2 FLOPs per weight per token: 2 * 1000 * 32 layers * (4 * 4096^2 + 3 * 4096 * 11008)
    assert sum(op(ops, n).flops for n in linear) == 12_952_010_752_000
    # causal: 1000 * 1001 / 2 (query, key) pairs, 4 FLOPs per pair per head dim per head
    assert op(ops, "attention").flops == 4 * 500_500 * 32 * 128 * 32
    assert op(ops, "lm_head").flops == 2 * 4096 * 32000  # logits of the last token only
    q = op(ops, "q_proj")
    assert q.bound == "compute"
    assert q.time_s == pytest.approx(2 * 1000 * 4096 * 4096 * 32 / H100_FLOPS)


def test_gqa_kv_is_read_once_per_kv_head_not_per_attention_head() -> None:
    # Llama-3.1-8B: 32 attention heads share 8 KV heads. LLM-Viewer's flash-decode counts
    # K/V loads per attention head (4x too many here); we count them per KV head.
    gqa = op(step("llama-3.1-8b").ops(Batch.decode(1, 1023)), "attention")
    kv_bytes = 1024 * 2 * 8 * 128 * 2 * 32  # 134,217,728
    per_token = (2 * 32 * 128 * 2 + 2 * 8 * 128 * 2) * 32  # Q read + O write, new K and V
    assert gqa.bytes == kv_bytes + per_token
    assert gqa.flops == 4 * 1024 * 32 * 128 * 32  # FLOPs still per attention head
    mha = op(step("llama-2-7b").ops(Batch.decode(1, 1023)), "attention")
    assert (gqa.bytes - per_token) * 4 == mha.bytes - (2 * 32 * 128 * 2 * 2) * 32
    # Llama-3.3-70B on 4 GPUs: each holds 2 of the 8 KV heads (and 16 of the 64 query heads)
    big = op(step("llama-3.3-70b", tp=4).ops(Batch.decode(64, 4095)), "attention")
    kv_70b = 64 * 4096 * 2 * 2 * 128 * 2 * 80
    assert big.bytes == kv_70b + 64 * (2 * 16 * 128 * 2 + 2 * 2 * 128 * 2) * 80


def test_tensor_parallel_shards_weights_and_replicates_scarce_kv_heads() -> None:
    # Llama-3.3-70B: hidden 8192, 64 heads, 8 KV heads, 80 layers.
    ops4 = step("llama-3.3-70b", tp=4).ops(Batch.decode(1, 0))
    assert op(ops4, "q_proj").bytes == 8192 * 16 * 128 * 2 * 80 + (8192 + 16 * 128) * 2 * 80
    assert op(ops4, "k_proj").bytes == 8192 * 2 * 128 * 2 * 80 + (8192 + 2 * 128) * 2 * 80
    # all-reduce: 2 per layer + the embedding's, ring over 4 GPUs on NVLink 4 (450 GB/s x 0.7)
    ar = op(ops4, "tp_allreduce")
    assert ar.time_s == pytest.approx(161 * (2 * 3 * 1e-6 + 2 * 3 / 4 * 8192 * 2 / (450e9 * 0.7)))
    assert ar.bound == "link"
    fit8 = memory_fit(CATALOG.model("llama-3.3-70b"), CATALOG.gpu("H100"), 8, DEFAULT)
    assert fit8.kv_bytes_per_token_per_gpu == 2 * 80 * 1 * 128 * 2  # one KV head per GPU
    assert not any(o.name == "tp_allreduce" for o in step("llama-3.1-8b").ops(Batch.decode(1, 0)))
    assert (
        check_tp(CATALOG.model("qwen2.5-7b"), 8)
        == "qwen2.5-7b: 28 attention heads do not split 8 ways"
    )
    assert check_tp(CATALOG.model("llama-3.1-8b"), 3) is not None
    assert check_tp(CATALOG.model("qwen3-30b-a3b"), 8) is None  # 4 KV heads, replicated


def test_moe_reads_only_the_experts_its_tokens_touch() -> None:
    # Mixtral-8x7B: 8 experts of 3 x 4096 x 14336, top-2, 32 layers.
    expert_bytes = 3 * 4096 * 14336 * 2 * 32  # one expert, all layers, bf16
    s = step("mixtral-8x7b", tp=2)
    one = op(s.ops(Batch.decode(1, 100)), "experts")
    # one token touches 2 experts; each GPU holds half of every expert
    assert one.bytes == pytest.approx(2 * expert_bytes / 2 + 2 * (2 * 4096 + 3 * 7168) * 2 * 32)
    assert one.flops == 2 * 3 * 2 * 4096 * 7168 * 32
    assert s.experts_touched(1) == pytest.approx(2.0)
    assert s.experts_touched(64) > 7.99  # a decode batch of 64 reads nearly all of them
    dense_equivalent = StepModel(CATALOG.model("mixtral-8x7b"), CATALOG.gpu("H100"), 2, DEFAULT)
    assert dense_equivalent.decode_time(1, 100) < dense_equivalent.decode_time(64, 100)


def test_weight_and_kv_quantization_shrink_bytes_and_grow_kv_capacity() -> None:
    base = step("llama-2-7b").ops(Batch.decode(1, 1023))
    w4 = step("llama-2-7b", weight_bits=4, kv_bits=8).ops(Batch.decode(1, 1023))
    assert op(w4, "q_proj").bytes == 4096 * 4096 * 32 // 2 + 524_288  # 4-bit weights
    assert op(w4, "lm_head").bytes == op(base, "lm_head").bytes  # kept 16-bit
    assert op(w4, "attention").bytes == 1024 * 2 * 32 * 128 * 1 * 32 + (16384 + 8192) * 32
    model, gpu = CATALOG.model("llama-2-7b"), CATALOG.gpu("RTX-3090")
    fp16 = memory_fit(model, gpu, 1, DEFAULT)
    quant = memory_fit(model, gpu, 1, RooflineConfig(weight_bits=4, kv_bits=8))
    assert quant.weight_bytes_per_gpu == 12_952_010_752 / 4 + 2 * 32000 * 4096 * 2
    assert quant.kv_bytes_per_token_per_gpu == fp16.kv_bytes_per_token_per_gpu / 2
    assert quant.kv_capacity_tokens > 4 * fp16.kv_capacity_tokens


def test_a_models_own_weight_width_wins_over_the_planner_wide_one() -> None:
    model, gpu = CATALOG.model("llama-2-7b"), CATALOG.gpu("RTX-3090")
    awq = replace(model, weight_bits=4)
    planner_wide = RooflineConfig(weight_bits=4)
    assert memory_fit(awq, gpu, 1, DEFAULT) == memory_fit(model, gpu, 1, planner_wide)
    assert memory_fit(awq, gpu, 1, RooflineConfig(weight_bits=8)) == memory_fit(
        model, gpu, 1, planner_wide
    )
    own = StepModel(awq, gpu, 1, DEFAULT).ops(Batch.decode(1, 1023))
    wide = StepModel(model, gpu, 1, planner_wide).ops(Batch.decode(1, 1023))
    assert own == wide
    assert op(own, "lm_head").bytes == 4096 * 32000 * 2 + (4096 + 32000) * 2  # kept 16-bit
    unset = memory_fit(model, gpu, 1, RooflineConfig(weight_bits=8))
    assert unset.weight_bytes_per_gpu == 12_952_010_752 / 2 + 2 * 32000 * 4096 * 2


def test_memory_fit_is_weights_plus_kv_within_the_usable_budget() -> None:
    fit = memory_fit(CATALOG.model("llama-2-7b"), CATALOG.gpu("RTX-3090"), 1, DEFAULT)
    assert fit.weight_bytes_per_gpu == 13_476_298_752  # 6.74 B parameters x 2 bytes
    assert fit.usable_bytes_per_gpu == pytest.approx((24 * 0.9 - 1.5) * 2**30)
    assert fit.kv_bytes_per_token_per_gpu == 524_288  # 2 x 32 layers x 32 heads x 128 x 2 B
    assert fit.kv_capacity_tokens == 15_460  # (usable - weights) // per-token
    too_big = memory_fit(CATALOG.model("llama-3.3-70b"), CATALOG.gpu("A100-80G"), 1, DEFAULT)
    assert not too_big.weights_fit


def test_tp_options_are_the_memory_feasible_even_shardings() -> None:
    lengths = Workload("llama-3.3-70b", 1, 900, 530).lengths(131072)
    m70 = CATALOG.model("llama-3.3-70b")
    assert tp_options(m70, CATALOG.gpu("A100-80G"), lengths) == [2, 4, 8]
    assert tp_options(m70, CATALOG.gpu("GH200"), lengths) == [2, 4]  # 4 per node
    assert tp_options(m70, CATALOG.gpu("RTX-3090"), lengths) == [8]
    assert tp_options(m70, CATALOG.gpu("MI300X"), lengths) == [1, 2, 4, 8]
    strict = ServingConfig(min_concurrency=64)  # 64 x 1430 tokens no longer fit on 2 A100s
    assert tp_options(m70, CATALOG.gpu("A100-80G"), lengths, serving=strict) == [4, 8]
    qwen = CATALOG.model("qwen2.5-7b")
    assert tp_options(qwen, CATALOG.gpu("H100"), lengths) == [1, 2, 4]


@pytest.mark.parametrize("model", ["llama-2-7b", "llama-3.1-8b"])
def test_rtx3090_is_3_2_to_3_4x_slower_than_h100_end_to_end(model: str) -> None:
    # The paper's Figure 6 target, for single requests with the §5 workloads' lengths (input
    # 600-1170 tokens, outputs of 256-530 tokens). Shorter outputs weigh the prefill, which is
    # compute-bound and 8-9x slower on the 3090 (71 vs 989 TFLOPS), more: see docs/scheduler.md.
    h100 = step(model, "H100-SXM")
    rtx = step(model, "RTX-3090")
    ratios = [
        rtx.request_latency(i, o) / h100.request_latency(i, o)
        for i in (600, 900, 1170)
        for o in (256, 400, 530)
    ]
    assert all(3.2 <= r <= 3.4 for r in ratios), ratios
    decode = rtx.decode_time(1, 1000) / h100.decode_time(1, 1000)
    prefill = rtx.prefill_time(1000) / h100.prefill_time(1000)
    assert 3.1 < decode < 3.4
    assert 7 < prefill < 10
