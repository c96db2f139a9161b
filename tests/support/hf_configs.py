"""Published Hugging Face ``config.json`` files of real models, field for field, for the tests of
``scheduler.hf_config`` and of ``fabric plan --catalog``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# meta-llama/Llama-3.1-8B-Instruct: dense, GQA (32 query / 8 KV heads), 8.03 B parameters.
LLAMA_3_1_8B_INSTRUCT: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 128256,
}

# mistralai/Mixtral-8x7B-v0.1: MoE, 8 experts, top-2; 46.7 B parameters, 12.9 B active.
MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1e6,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}

# Qwen/Qwen3-30B-A3B: MoE, 128 narrow experts, top-8, head_dim given; 30.5 B / 3.3 B active.
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Qwen/Qwen1.5-MoE-A2.7B: MoE with a shared expert; 14.3 B parameters, 2.7 B active.
QWEN1_5_MOE_A2_7B: dict[str, Any] = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5632,
    "max_position_embeddings": 8192,
    "max_window_layers": 21,
    "model_type": "qwen2_moe",
    "moe_intermediate_size": 1408,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 16,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 5632,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.39.0.dev0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# TheBloke/Llama-2-13B-chat-AWQ: Llama-2-13B (MHA, 13.0 B parameters) with 4-bit AWQ weights.
LLAMA_2_13B_CHAT_AWQ: dict[str, Any] = {
    "_name_or_path": "/workspace/process/llama-2-13b-chat/source",
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 13824,
    "max_position_embeddings": 4096,
    "model_type": "llama",
    "num_attention_heads": 40,
    "num_hidden_layers": 40,
    "num_key_value_heads": 40,
    "pad_token_id": 0,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.35.0",
    "use_cache": True,
    "vocab_size": 32000,
    "quantization_config": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
        "version": "gemm",
    },
}


def model_dir(parent: Path, name: str, config: dict[str, Any]) -> Path:
    """A model directory ``parent/name`` holding ``config`` as its config.json."""
    directory = parent / name
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
