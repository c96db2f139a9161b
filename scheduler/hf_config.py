"""A model's catalog entry derived from its Hugging Face ``config.json``: plan any model.

Researchers serve whatever they downloaded; the directory they give ``vllm serve`` holds a
``config.json`` with the architecture. ``model_spec(source)`` turns one (a parsed dict, a
``config.json`` path, or a model directory holding one) into a ``ModelSpec``. Pure but for
reading that one file; standard library only.

Fields read (the first of each list that is present and not null; ``text_config`` first):

============================  ================================================================
ModelSpec field               config.json field(s)
============================  ================================================================
layers                        num_hidden_layers, n_layer, num_layers, n_layers
hidden                        hidden_size, d_model, n_embd
heads                         num_attention_heads, n_head, n_heads
kv_heads                      num_key_value_heads, num_kv_heads; else 1 when ``multi_query`` is
                              true (Falcon, StarCoder); else heads (no GQA)
head_dim                      head_dim; else hidden / heads
intermediate                  intermediate_size, ffn_dim, n_inner; for a MoE without one,
                              moe_intermediate_size
vocab                         vocab_size, padded_vocab_size
max_context                   max_position_embeddings, max_sequence_length, seq_length,
                              n_positions, max_seq_len. ``rope_scaling`` is not applied: engines
                              differ in how they extend the context, and the shorter limit only
                              makes the planner cap request lengths a little early
tie_embeddings                tie_word_embeddings; when absent, the default of the model's
                              transformers config class: true for bloom, cohere, falcon, gemma,
                              gemma2, gemma3_text, gpt2, gpt_bigcode, mpt, opt and starcoder2;
                              false for the rest (the Llama, Mistral and Qwen families')
experts                       num_local_experts, num_experts, n_routed_experts (0 or 1: dense)
experts_per_token             num_experts_per_tok, experts_per_token (needed with experts)
expert_intermediate           moe_intermediate_size; else intermediate
shared_expert_intermediate    shared_expert_intermediate_size (Qwen-MoE); else n_shared_experts
                              x expert_intermediate (DeepSeek-MoE); else 0
weight_bits                   see Precision
============================  ================================================================

Multimodal configs keep the language model under ``text_config``: it is read when present (the
vision tower is not counted); field names in errors then read ``text_config.<field>``.

Precision, ``weight_bits`` (the width the transformer blocks' weights are served at; embeddings
and lm_head stay 16-bit in the roofline, as quantized checkpoints keep them):

* ``quantization_config`` present: ``bits``, ``w_bit`` or ``weight_bits`` (GPTQ, AWQ, ...);
  ``load_in_4bit`` / ``load_in_8bit`` (bitsandbytes); for ``compressed-tensors`` the widest
  ``config_groups.*.weights.num_bits`` (no weight scheme: weights unquantized, as below);
  without a width, ``quant_method`` fp8, fbgemm_fp8 or eetq means 8 and mxfp4 means 4. A
  width outside 4, 8, 16 and 32 or a method whose width cannot be told is an error.
* otherwise the checkpoint holds 16- or 32-bit floats (``torch_dtype`` or ``dtype``: float16,
  bfloat16 or float32; absent is fine): ``None``, the planner-wide ``RooflineConfig.weight_bits``
  (16 by default). A float32 checkpoint is served at 16 bits, as engines load it (vLLM's
  ``--dtype auto`` picks a 16-bit type for fp32 checkpoints).

Approximations (the entry is an estimate, as the TOML entries are): every MLP is counted as
gated (three matrices; a plain two-matrix MLP such as GPT-2's is overcounted); every layer of a
MoE is counted as a MoE layer (DeepSeek's dense first layers, Qwen-MoE's ``mlp_only_layers``
and ``decoder_sparse_step``); sliding-window layers are counted with a full KV cache; norms,
biases and multi-token-prediction heads are not counted. Two architectures the planner would get
badly wrong are refused: encoder-decoder models (``is_encoder_decoder``) and multi-head latent
attention (``kv_lora_rank``, DeepSeek-V2/V3), whose KV cache is far smaller than per-head K/V.

Naming (``model_spec`` of a path): the model is named by its directory's absolute path
(``specs.local_model_name``: ``~`` expanded, no trailing slash, ``config.json`` stripped), so an
engine template's ``vllm serve {model}`` gets a path the engine can load and agents serving that
directory announce the same id; another ``*.json`` file is named by its own absolute path.
Aliases: the directory's name (the file's stem for another ``*.json``) and ``_name_or_path``
when it is a hub id (not a local path). ``source`` is the ``config.json`` path as given.

Errors are ``CatalogError``s naming the file and the config.json field: a field missing, of the
wrong type or not positive, shapes that do not fit (heads not a multiple of KV heads), an
unknown precision; a file that cannot be read or is not a JSON object; a directory without a
``config.json``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from scheduler.errors import CatalogError
from scheduler.specs import WEIGHT_BITS, ModelSpec, is_local_path, local_model_name

CONFIG_FILE = "config.json"

LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HIDDEN = ("hidden_size", "d_model", "n_embd")
HEADS = ("num_attention_heads", "n_head", "n_heads")
KV_HEADS = ("num_key_value_heads", "num_kv_heads")
INTERMEDIATE = ("intermediate_size", "ffn_dim", "n_inner")
VOCAB = ("vocab_size", "padded_vocab_size")
CONTEXT = (
    "max_position_embeddings",
    "max_sequence_length",
    "seq_length",
    "n_positions",
    "max_seq_len",
)
EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
EXPERTS_PER_TOKEN = ("num_experts_per_tok", "experts_per_token")
DTYPE = ("torch_dtype", "dtype")

# Model types whose transformers config class ties the embeddings unless told otherwise.
TIED_BY_DEFAULT = frozenset(
    {
        "bloom",
        "cohere",
        "falcon",
        "gemma",
        "gemma2",
        "gemma3_text",
        "gpt2",
        "gpt_bigcode",
        "mpt",
        "opt",
        "starcoder2",
    }
)
# Checkpoint dtypes an engine serves at 16 bits (float32 is cast down).
FLOAT_DTYPES = frozenset(
    {"float16", "bfloat16", "float32", "half", "float", "bf16", "fp16", "fp32", "auto"}
)
# Quantization methods whose weight width is fixed when the config does not give ``bits``.
FIXED_WIDTH_METHODS = {"fp8": 8, "fbgemm_fp8": 8, "eetq": 8, "mxfp4": 4}
BITS_KEYS = ("bits", "w_bit", "weight_bits")


def model_spec(
    source: Mapping[str, Any] | str | Path,
    *,
    name: str | None = None,
    origin: str | None = None,
    aliases: Sequence[str] = (),
) -> ModelSpec:
    """The ``ModelSpec`` of a parsed config dict, a ``config.json`` file or a model directory.

    For a path, ``name`` defaults to its ``local_model_name`` and the aliases, ``source`` and
    error origin follow the module's naming rules. A dict needs ``name``; ``origin`` (default
    ``"config.json"``) prefixes its errors.
    """
    if isinstance(source, Mapping):
        if name is None:
            raise ValueError("model_spec of a config dict needs name=")
        return _spec(source, name, origin or CONFIG_FILE, tuple(aliases), "")
    file = config_file(source)
    config = read_config(file)
    path_name = local_model_name(source)
    own_alias = Path(path_name).name if file.name == CONFIG_FILE else Path(path_name).stem
    hub_id = config.get("_name_or_path")
    found = [own_alias, *aliases]
    if isinstance(hub_id, str) and hub_id.strip() and not is_local_path(hub_id):
        found.append(hub_id)
    unique = tuple(dict.fromkeys(a for a in found if a and a != path_name))
    return _spec(config, name or path_name, origin or str(file), unique, str(file))


def config_file(source: str | Path) -> Path:
    """The ``config.json`` of a model directory, or ``source`` itself when it is a file."""
    path = Path(source).expanduser()
    try:
        is_dir = path.is_dir()
        missing = is_dir and not (path / CONFIG_FILE).is_file()
    except OSError as exc:  # permission denied on the way, a name too long for a path
        raise CatalogError(f"{source}: cannot read config file: {exc.strerror}") from None
    if is_dir:
        file = path / CONFIG_FILE
        if missing:
            raise CatalogError(
                f"{source}: no {CONFIG_FILE} in this directory (a Hugging Face model directory "
                f"holds one)"
            )
        return file
    return path


def locate(name: str) -> Path | None:
    """The ``config.json`` a path-shaped model id points at (a model directory holding one, or a
    ``*.json`` file), or None when there is none: how ``Catalog.model`` finds local models."""
    path = Path(name).expanduser()
    try:
        if path.is_dir():
            file = path / CONFIG_FILE
            return file if file.is_file() else None
        if path.suffix.lower() == ".json" and path.is_file():
            return path
    except OSError:  # a name too long for a path, a permission denied on the way
        return None
    return None


def read_config(file: str | Path) -> dict[str, Any]:
    """The JSON object of one config file; ``CatalogError`` naming it otherwise."""
    try:
        text = Path(file).read_text(encoding="utf-8")
    except OSError as exc:
        raise CatalogError(f"{file}: cannot read config file: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise CatalogError(f"{file}: not valid JSON: not UTF-8 text") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CatalogError(f"{file}: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CatalogError(f"{file}: expected a JSON object of config fields")
    return config


# -- reading fields ---------------------------------------------------------------------------


class _Fields:
    """Typed reads of one config object; errors name the file and the field."""

    def __init__(self, config: Mapping[str, Any], origin: str, prefix: str = "") -> None:
        self.config = config
        self.origin = origin
        self.prefix = prefix

    def error(self, key: str, problem: str) -> CatalogError:
        return CatalogError(f"{self.origin}: field {self.prefix + key!r} {problem}")

    def find(self, keys: Sequence[str]) -> tuple[str, Any] | None:
        for key in keys:
            value = self.config.get(key)
            if value is not None:
                return key, value
        return None

    def integer(self, keys: Sequence[str], default: int | None = None, minimum: int = 1) -> int:
        """The first of ``keys`` as an integer of at least ``minimum``; ``default`` when none is
        there (None: the field is required)."""
        found = self.find(keys)
        if found is None:
            if default is not None:
                return default
            others = ", ".join(repr(self.prefix + k) for k in keys[1:])
            also = f" (also looked for {others})" if others else ""
            raise self.error(keys[0], f"is missing{also}")
        key, value = found
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            kind = "a positive integer" if minimum >= 1 else "an integer, zero or more"
            raise self.error(key, f"must be {kind}, got {json.dumps(value)}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {json.dumps(value)}")
        return value


def _text_fields(config: Mapping[str, Any], origin: str) -> _Fields:
    text = config.get("text_config")
    if text is None:
        return _Fields(config, origin)
    if not isinstance(text, dict):
        raise _Fields(config, origin).error("text_config", "must be an object of config fields")
    return _Fields(text, origin, "text_config.")


def _spec(
    config: Mapping[str, Any], name: str, origin: str, aliases: tuple[str, ...], source: str
) -> ModelSpec:
    top = _Fields(config, origin)
    f = _text_fields(config, origin)
    for fields in (top, f):
        if fields.flag("is_encoder_decoder", False):
            raise fields.error(
                "is_encoder_decoder", "is true: only decoder-only transformers are modelled"
            )
        if fields.find(("kv_lora_rank",)) is not None:
            raise fields.error(
                "kv_lora_rank",
                "is set: multi-head latent attention (DeepSeek-V2/V3) is not modelled (its KV "
                "cache is far smaller than per-head K/V)",
            )
    layers = f.integer(LAYERS)
    hidden = f.integer(HIDDEN)
    heads = f.integer(HEADS)
    kv_heads = _kv_heads(f, heads)
    head_dim = f.integer(("head_dim",), default=0)
    if not head_dim:
        if hidden % heads:
            hkey = f.find(HIDDEN)
            raise f.error(
                hkey[0] if hkey else HIDDEN[0],
                f"({hidden}) is not a multiple of the attention heads ({heads}) and "
                f"{f.prefix}head_dim is not given",
            )
        head_dim = hidden // heads
    experts = f.integer(EXPERTS, default=0, minimum=0)
    moe = experts > 1
    moe_width = f.integer(("moe_intermediate_size",), default=0) if moe else 0
    intermediate = f.integer(INTERMEDIATE, default=moe_width or None)
    per_token = expert_width = shared = 0
    if moe:
        per_token = f.integer(EXPERTS_PER_TOKEN)
        if per_token > experts:
            key = f.find(EXPERTS_PER_TOKEN)
            raise f.error(
                key[0] if key else EXPERTS_PER_TOKEN[0],
                f"must be at most the number of experts ({experts}), got {per_token}",
            )
        expert_width = moe_width or intermediate
        if f.find(("shared_expert_intermediate_size",)) is not None:
            shared = f.integer(("shared_expert_intermediate_size",), minimum=0)
        else:
            shared = f.integer(("n_shared_experts",), default=0, minimum=0) * expert_width
    else:
        experts = 0
    model_type = f.config.get("model_type")
    tied_default = isinstance(model_type, str) and model_type in TIED_BY_DEFAULT
    return ModelSpec(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=f.integer(VOCAB),
        max_context=f.integer(CONTEXT),
        tie_embeddings=f.flag("tie_word_embeddings", tied_default),
        experts=experts,
        experts_per_token=per_token,
        expert_intermediate=expert_width,
        shared_expert_intermediate=shared,
        weight_bits=_weight_bits(top, f),
        aliases=aliases,
        source=source,
    )


def _kv_heads(f: _Fields, heads: int) -> int:
    found = f.find(KV_HEADS)
    if found is not None:
        kv = f.integer(KV_HEADS)
        key = found[0]
    elif f.flag("multi_query", False):
        kv, key = 1, "multi_query"
    else:
        return heads
    if heads % kv:
        raise f.error(key, f"({kv} KV heads) must divide the attention heads ({heads})")
    return kv


# -- precision --------------------------------------------------------------------------------


def _weight_bits(top: _Fields, text: _Fields) -> int | None:
    """The served width of the transformer blocks' weights; None: unquantized (module doc)."""
    for fields in (top, text):
        if fields.find(("quantization_config",)) is not None:
            return _quantized_bits(fields)
    for fields in (top, text):
        found = fields.find(DTYPE)
        if found is not None:
            key, value = found
            dtype = value.removeprefix("torch.").lower() if isinstance(value, str) else None
            if dtype not in FLOAT_DTYPES:
                raise fields.error(
                    key,
                    f"must be float16, bfloat16 or float32 (a quantized checkpoint gives "
                    f"quantization_config), got {json.dumps(value)}",
                )
            return None
    return None


def _quantized_bits(parent: _Fields) -> int | None:
    q = parent.config["quantization_config"]
    if not isinstance(q, dict):
        raise parent.error("quantization_config", f"must be an object, got {json.dumps(q)}")
    f = _Fields(q, parent.origin, parent.prefix + "quantization_config.")
    method = q.get("quant_method")
    method = method.lower() if isinstance(method, str) else None
    if method == "bitsandbytes" or "load_in_4bit" in q or "load_in_8bit" in q:
        if f.flag("load_in_4bit", False):
            return 4
        if f.flag("load_in_8bit", False):
            return 8
        raise f.error(
            "load_in_4bit", "is not true, nor is load_in_8bit: cannot tell the weight width"
        )
    if method == "compressed-tensors":
        return _compressed_tensors_bits(f)
    found = f.find(BITS_KEYS)
    if found is not None:
        return _check_bits(f, found[0], found[1])
    if method in FIXED_WIDTH_METHODS:
        return FIXED_WIDTH_METHODS[method]
    raise f.error(
        "quant_method",
        f"is {json.dumps(method)}, which gives no weight width without {' or '.join(BITS_KEYS)}: "
        "describe the model in a TOML catalog entry with weight_bits",
    )


def _compressed_tensors_bits(f: _Fields) -> int | None:
    groups = f.config.get("config_groups")
    if groups is None:
        return None
    if not isinstance(groups, dict):
        raise f.error("config_groups", f"must be an object, got {json.dumps(groups)}")
    widths: list[int] = []
    for group_name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if weights is None:
            continue
        key = f"config_groups.{group_name}.weights.num_bits"
        bits = weights.get("num_bits") if isinstance(weights, dict) else None
        widths.append(_check_bits(f, key, bits))
    return max(widths) if widths else None  # no weight scheme: 16-bit weights


def _check_bits(f: _Fields, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in WEIGHT_BITS:
        raise f.error(
            key,
            f"must be 4, 8, 16 or 32 (the weight widths the planner models), got "
            f"{json.dumps(value)}",
        )
    return value
