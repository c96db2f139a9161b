"""What the catalogs describe: a GPU type (``GpuSpec``) and a model architecture (``ModelSpec``).

The records and the naming of local models (``is_local_path``, ``local_model_name``), below
both ways of making them: ``catalog`` (the TOML catalogs, lookups by name) and ``hf_config`` (an
entry from a Hugging Face ``config.json``, which ``Catalog.model`` reads for a path-shaped name).
Here so that the two import this module and ``catalog`` imports ``hf_config``, not each other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

GIB = 1024**3
WEIGHT_BITS = (4, 8, 16, 32)  # the weight widths the roofline models


@dataclass(frozen=True)
class GpuSpec:
    """One GPU type, per device as a job gets it (see data/gpus.toml for units)."""

    name: str
    vendor: str
    memory_gb: float
    bf16_tflops: float
    memory_bw_gbs: float
    link: str
    link_gbs: float
    link_latency_us: float
    gpus_per_node: int
    compute_efficiency: float | None = None
    bandwidth_efficiency: float | None = None
    aliases: tuple[str, ...] = ()
    source: str = ""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * GIB

    @property
    def peak_flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def memory_bw_bytes_s(self) -> float:
        return self.memory_bw_gbs * 1e9

    @property
    def link_bw_bytes_s(self) -> float:
        return self.link_gbs * 1e9


@dataclass(frozen=True)
class ModelSpec:
    """One decoder-only transformer with a gated (SwiGLU) MLP or MoE of gated experts."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_context: int
    tie_embeddings: bool = False
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    weight_bits: int | None = None  # None: the planner-wide RooflineConfig.weight_bits
    aliases: tuple[str, ...] = ()
    source: str = ""

    @property
    def is_moe(self) -> bool:
        return self.experts > 1

    @property
    def attention_params_per_layer(self) -> int:
        """q, k, v and o projections."""
        d = self.head_dim
        return self.hidden * (self.heads + 2 * self.kv_heads) * d + self.heads * d * self.hidden

    @property
    def mlp_params_per_layer(self) -> int:
        """All MLP weights of one layer (every expert, the router and any shared expert)."""
        if not self.is_moe:
            return 3 * self.hidden * self.intermediate
        return (
            self.experts * 3 * self.hidden * self.expert_intermediate
            + self.hidden * self.experts
            + 3 * self.hidden * self.shared_expert_intermediate
        )

    @property
    def active_mlp_params_per_layer(self) -> int:
        """MLP weights one token goes through (its top-k experts, router, shared expert)."""
        if not self.is_moe:
            return self.mlp_params_per_layer
        return (
            self.experts_per_token * 3 * self.hidden * self.expert_intermediate
            + self.hidden * self.experts
            + 3 * self.hidden * self.shared_expert_intermediate
        )

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the lm_head (counted once when they are tied)."""
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    @property
    def params(self) -> int:
        layer = self.attention_params_per_layer + self.mlp_params_per_layer
        return self.layers * layer + self.embedding_params

    @property
    def active_params(self) -> int:
        layer = self.attention_params_per_layer + self.active_mlp_params_per_layer
        return self.layers * layer + self.embedding_params

    def kv_bytes_per_token(self, kv_bits: int = 16) -> float:
        """K and V of every layer for one token, whole model (not per TP shard)."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * kv_bits / 8


# -- schema -----------------------------------------------------------------------------------


def is_local_path(name: str) -> bool:
    """Whether a model name is a local filesystem path (starts with ``/``, ``~`` or ``.``)."""
    return name.startswith(("/", "~", "."))


def local_model_name(path: str | Path) -> str:
    """The name of a model served from ``path``: its absolute path, ``~`` expanded, without a
    trailing slash or a final ``config.json`` (symlinks are kept, as the engine is given them)."""
    text = os.path.expanduser(os.fspath(path).strip())
    head, tail = os.path.split(text.rstrip("/"))
    if tail == "config.json":
        text = head or "."
    return os.path.abspath(text)
