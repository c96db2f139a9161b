"""Build a LoRA adapter for the tiny model of ``make_tiny_model.py``, entirely offline.

    python make_tiny_lora.py MODEL_DIR OUT_DIR [RANK]

Run with the vLLM venv's interpreter (it needs torch and safetensors). The adapter is what
PEFT saves for a Llama with LoRA on ``q_proj`` and ``v_proj``: ``adapter_config.json`` and
``adapter_model.safetensors`` holding, for every layer ``i``,

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight  [rank, hidden]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight  [heads * head_dim, rank]
    base_model.model.model.layers.{i}.self_attn.v_proj.lora_A.weight  [rank, hidden]
    base_model.model.model.layers.{i}.self_attn.v_proj.lora_B.weight  [kv_heads * head_dim, rank]

with the sizes read from the model's ``config.json``. The weights are random (seeded), and B is
not zero as a freshly initialised PEFT adapter's is, so the adapter changes the output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

TARGETS = ("q_proj", "v_proj")


def build(model_dir: Path, out: Path, rank: int = 8, seed: int = 0) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    outputs = {
        "q_proj": heads * head_dim,
        "v_proj": config.get("num_key_value_heads", heads) * head_dim,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            a = torch.randn(rank, hidden, generator=generator) / hidden**0.5
            b = torch.randn(outputs[target], rank, generator=generator) * 0.05
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")


def main() -> None:
    if len(sys.argv) not in (3, 4):
        sys.exit(f"usage: {sys.argv[0]} MODEL_DIR OUT_DIR [RANK]")
    rank = int(sys.argv[3]) if len(sys.argv) == 4 else 8
    build(Path(sys.argv[1]), Path(sys.argv[2]), rank)
    print(f"LoRA adapter (rank {rank}, {', '.join(TARGETS)}) written to {sys.argv[2]}")


if __name__ == "__main__":
    main()
