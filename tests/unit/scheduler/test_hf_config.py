"""Model entries from Hugging Face config.json files: published configs against the published
sizes and the built-in entries, precision from quantization_config, naming of model directories,
their place in the catalog (load_catalog, lookups by path), and one clear error per bad field."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from fabricnode.errors import ConfigError
from scheduler.catalog import ModelSpec, builtin_catalog, load_catalog, local_model_name
from scheduler.errors import CatalogError
from scheduler.hf_config import model_spec
from scheduler.replica import tp_options
from scheduler.roofline import RooflineConfig, memory_fit
from scheduler.workload import Workload, parse_workloads
from tests.support.hf_configs import (
    LLAMA_2_13B_CHAT_AWQ,
    LLAMA_3_1_8B_INSTRUCT,
    MIXTRAL_8X7B,
    QWEN1_5_MOE_A2_7B,
    QWEN3_30B_A3B,
    model_dir,
)

ARCHITECTURE = [f.name for f in fields(ModelSpec) if f.name not in ("name", "aliases", "source")]


def spec(config: dict[str, Any], **changes: Any) -> ModelSpec:
    return model_spec({**config, **changes}, name="m")


@pytest.mark.parametrize(
    ("config", "total_b", "active_b"),
    [
        (LLAMA_3_1_8B_INSTRUCT, 8.03, 8.03),
        (MIXTRAL_8X7B, 46.7, 12.9),
        (QWEN3_30B_A3B, 30.5, 3.3),
        (QWEN1_5_MOE_A2_7B, 14.3, 2.7),
        (LLAMA_2_13B_CHAT_AWQ, 13.0, 13.0),
    ],
)
def test_published_configs_give_the_published_parameter_counts(
    config: dict[str, Any], total_b: float, active_b: float
) -> None:
    model = spec(config)
    assert model.params / 1e9 == pytest.approx(total_b, rel=0.01)
    assert model.active_params / 1e9 == pytest.approx(active_b, rel=0.02)


@pytest.mark.parametrize(
    ("config", "builtin"),
    [
        (LLAMA_3_1_8B_INSTRUCT, "llama-3.1-8b"),
        (MIXTRAL_8X7B, "mixtral-8x7b"),
        (QWEN3_30B_A3B, "qwen3-30b-a3b"),
    ],
)
def test_derived_specs_equal_the_builtin_entries(config: dict[str, Any], builtin: str) -> None:
    derived, shipped = spec(config), builtin_catalog().model(builtin)
    assert {f: getattr(derived, f) for f in ARCHITECTURE} == {
        f: getattr(shipped, f) for f in ARCHITECTURE
    }
    assert derived.weight_bits is None  # bfloat16: the planner-wide width, as the built-in


def test_a_model_directory_is_named_by_its_path_with_its_name_and_hub_id_as_aliases(
    tmp_path: Path,
) -> None:
    config = {**LLAMA_3_1_8B_INSTRUCT, "_name_or_path": "meta-llama/Llama-3.1-8B-Instruct"}
    directory = model_dir(tmp_path / "models", "my-llama", config)
    for given in (directory, f"{directory}/", directory / "config.json"):
        model = model_spec(given)
        assert model.name == str(directory)
        assert model.aliases == ("my-llama", "meta-llama/Llama-3.1-8B-Instruct")
        assert model.source == str(directory / "config.json")
    assert local_model_name("~/models/x/config.json") == str(Path.home() / "models/x")
    # A local path in _name_or_path (where the checkpoint was converted) is no alias.
    awq = model_spec(model_dir(tmp_path, "Llama-2-13B-chat-AWQ", LLAMA_2_13B_CHAT_AWQ))
    assert awq.aliases == ("Llama-2-13B-chat-AWQ",)
    # Any other *.json file is named by its own path, aliased by its stem.
    other = tmp_path / "tiny.json"
    other.write_text(json.dumps(LLAMA_3_1_8B_INSTRUCT))
    assert (model_spec(other).name, model_spec(other).aliases) == (str(other), ("tiny",))


def test_a_relative_directory_is_named_by_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir(tmp_path, "models/my-llama", LLAMA_3_1_8B_INSTRUCT)
    monkeypatch.chdir(tmp_path)
    assert model_spec("models/my-llama/").name == str(tmp_path / "models/my-llama")
    assert model_spec("./models/../models/my-llama").name == str(tmp_path / "models/my-llama")


# -- precision --------------------------------------------------------------------------------


def test_a_4_bit_checkpoint_takes_a_quarter_of_the_weight_bytes_and_fewer_gpus() -> None:
    awq = spec(LLAMA_2_13B_CHAT_AWQ)
    fp16 = builtin_catalog().model("llama-2-13b")
    assert awq.weight_bits == 4 and fp16.weight_bits is None
    assert {f: getattr(awq, f) for f in ARCHITECTURE if f != "weight_bits"} == {
        f: getattr(fp16, f) for f in ARCHITECTURE if f != "weight_bits"
    }
    gpu, cfg = builtin_catalog().gpu("RTX-3090"), RooflineConfig()
    quant, full = memory_fit(awq, gpu, 1, cfg), memory_fit(fp16, gpu, 1, cfg)
    assert 0.26 < quant.weight_bytes_per_gpu / full.weight_bytes_per_gpu < 0.3
    blocks = awq.params - awq.embedding_params
    assert quant.weight_bytes_per_gpu == blocks / 2 + awq.embedding_params * 2  # embeddings 16-bit
    lengths = Workload("m", 1.0, 1000, 200).lengths(awq.max_context)
    assert tp_options(awq, gpu, lengths)[0] == 1
    assert tp_options(fp16, gpu, lengths)[0] == 2


@pytest.mark.parametrize(
    ("changes", "bits"),
    [
        ({"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": 128}}, 8),
        ({"quantization_config": {"quant_method": "awq", "w_bit": 4, "q_group_size": 128}}, 4),
        ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}, 4),
        ({"quantization_config": {"load_in_8bit": True, "load_in_4bit": False}}, 8),
        ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}, 8),
        ({"quantization_config": {"quant_method": "mxfp4"}}, 4),
        (
            {
                "quantization_config": {
                    "quant_method": "compressed-tensors",
                    "format": "pack-quantized",
                    "config_groups": {
                        "group_0": {
                            "targets": ["Linear"],
                            "weights": {"num_bits": 4, "type": "int", "group_size": 128},
                            "input_activations": None,
                        }
                    },
                }
            },
            4,
        ),
        (
            {
                "quantization_config": {
                    "quant_method": "compressed-tensors",
                    "config_groups": {"group_0": {"weights": None}},
                    "kv_cache_scheme": {"num_bits": 8, "type": "float"},
                }
            },
            None,
        ),
        ({"torch_dtype": "float32"}, None),  # served at 16 bits
        ({"torch_dtype": None, "dtype": "float16"}, None),
        ({"torch_dtype": None}, None),
    ],
)
def test_weight_width_comes_from_quantization_config_else_the_planner(
    changes: dict[str, Any], bits: int | None
) -> None:
    assert spec(LLAMA_3_1_8B_INSTRUCT, **changes).weight_bits == bits


# -- other architectures ----------------------------------------------------------------------


def test_multimodal_configs_are_read_from_text_config() -> None:
    llava = {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "text_config": LLAMA_3_1_8B_INSTRUCT,
        "vision_config": {"hidden_size": 1024, "num_hidden_layers": 24, "model_type": "clip"},
        "quantization_config": {"quant_method": "awq", "bits": 4},
    }
    model = model_spec(llava, name="m")
    assert model.params == spec(LLAMA_3_1_8B_INSTRUCT).params  # the vision tower is not counted
    assert model.weight_bits == 4
    broken = {**llava, "text_config": {**LLAMA_3_1_8B_INSTRUCT, "vocab_size": "big"}}
    with pytest.raises(CatalogError, match=r"field 'text_config.vocab_size' must be a positive"):
        model_spec(broken, name="m")


def test_older_field_names_multi_query_and_default_head_dim_and_tying() -> None:
    starcoder = {
        "model_type": "gpt_bigcode",
        "n_layer": 40,
        "n_embd": 6144,
        "n_head": 48,
        "n_inner": 24576,
        "n_positions": 8192,
        "multi_query": True,
        "vocab_size": 49152,
    }
    model = model_spec(starcoder, name="m")
    assert (model.layers, model.hidden, model.heads, model.kv_heads) == (40, 6144, 48, 1)
    assert (model.head_dim, model.intermediate, model.max_context) == (128, 24576, 8192)
    assert model.tie_embeddings  # gpt_bigcode ties unless told otherwise
    untold = {k: v for k, v in LLAMA_3_1_8B_INSTRUCT.items() if k != "tie_word_embeddings"}
    assert not model_spec(untold, name="m").tie_embeddings  # Llama does not
    assert spec(LLAMA_3_1_8B_INSTRUCT, head_dim=None, num_key_value_heads=None).kv_heads == 32
    deepseek_moe = spec(
        MIXTRAL_8X7B,
        num_local_experts=None,
        n_routed_experts=64,
        num_experts_per_tok=6,
        moe_intermediate_size=1408,
        n_shared_experts=2,
    )
    assert (deepseek_moe.experts, deepseek_moe.expert_intermediate) == (64, 1408)
    assert deepseek_moe.shared_expert_intermediate == 2 * 1408
    assert spec(MIXTRAL_8X7B, num_local_experts=1).experts == 0  # one expert is a dense MLP


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"num_hidden_layers": None},
            r"field 'num_hidden_layers' is missing \(also looked for 'n_layer'",
        ),
        (
            {"num_hidden_layers": "32"},
            r"'num_hidden_layers' must be a positive integer, got \"32\"",
        ),
        ({"hidden_size": 4096.0}, r"field 'hidden_size' must be a positive integer, got 4096.0"),
        ({"vocab_size": 0}, r"field 'vocab_size' must be a positive integer, got 0"),
        ({"num_key_value_heads": 6}, r"'num_key_value_heads' \(6 KV heads\) must divide .* \(32\)"),
        ({"num_attention_heads": 24}, r"'hidden_size' \(4096\) is not a multiple of .* \(24\)"),
        ({"tie_word_embeddings": "no"}, r"field 'tie_word_embeddings' must be true or false"),
        ({"num_local_experts": 8}, r"field 'num_experts_per_tok' is missing"),
        (
            {"num_local_experts": 8, "num_experts_per_tok": 9},
            r"'num_experts_per_tok' must be at most",
        ),
        (
            {"quantization_config": {"quant_method": "gptq", "bits": 3}},
            r"field 'quantization_config.bits' must be 4, 8, 16 or 32 .*got 3",
        ),
        (
            {"quantization_config": {"quant_method": "hqq"}},
            r"field 'quantization_config.quant_method' is \"hqq\", which gives no weight width",
        ),
        (
            {"quantization_config": {"quant_method": "bitsandbytes"}},
            r"field 'quantization_config.load_in_4bit' is not true, nor is load_in_8bit",
        ),
        ({"quantization_config": "awq"}, r"field 'quantization_config' must be an object"),
        ({"torch_dtype": "int8"}, r"field 'torch_dtype' must be float16, bfloat16 or float32"),
        ({"kv_lora_rank": 512}, r"field 'kv_lora_rank' is set: multi-head latent attention"),
        ({"is_encoder_decoder": True}, r"field 'is_encoder_decoder' is true"),
        ({"text_config": [1]}, r"field 'text_config' must be an object"),
    ],
)
def test_a_bad_field_is_one_error_naming_the_file_and_the_field(
    tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    config = {**LLAMA_3_1_8B_INSTRUCT, **changes}
    directory = model_dir(tmp_path, "broken", {k: v for k, v in config.items() if v is not None})
    with pytest.raises(CatalogError, match=message) as info:
        model_spec(directory)
    assert str(info.value).startswith(f"{directory / 'config.json'}: field ")
    assert isinstance(info.value, ConfigError)  # the CLI prints it as one line
    with pytest.raises(CatalogError, match=message):
        load_catalog([directory])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"num_hidden_layers": 32,', r"config.json: not valid JSON"),
        (b"\xff\xfe{}", r"config.json: not valid JSON: not UTF-8"),
        ("[1, 2]", r"config.json: expected a JSON object"),
        (None, r"broken: no config.json in this directory"),
    ],
)
def test_unreadable_configs_are_one_error_naming_the_path(
    tmp_path: Path, content: str | bytes | None, message: str
) -> None:
    directory = tmp_path / "broken"
    directory.mkdir()
    if isinstance(content, bytes):
        (directory / "config.json").write_bytes(content)
    elif content is not None:
        (directory / "config.json").write_text(content)
    with pytest.raises(CatalogError, match=message):
        load_catalog([directory])
    with pytest.raises(CatalogError, match=r"nope.json: cannot read config file"):
        load_catalog([tmp_path / "nope.json"])


# -- in the catalog ---------------------------------------------------------------------------


def test_load_catalog_takes_a_config_json_or_a_model_directory(tmp_path: Path) -> None:
    directory = model_dir(tmp_path, "my-llama", LLAMA_3_1_8B_INSTRUCT)
    for given in (directory, directory / "config.json"):
        catalog = load_catalog([given])
        model = catalog.model(str(directory))
        assert catalog.models[str(directory)] == model
        for name in (f"{directory}/", f"{directory}/config.json", "my-llama", "My_Llama"):
            assert catalog.model(name) is model, name
        assert catalog.model("llama-3.1-8b").name == "llama-3.1-8b"  # the built-ins stay
    twice = load_catalog([directory, directory / "config.json"])  # the second replaces the first
    assert twice.model("my-llama").name == str(directory)


def test_a_local_directory_named_like_a_builtin_keeps_its_path_and_leaves_the_name(
    tmp_path: Path,
) -> None:
    directory = model_dir(tmp_path, "Llama-2-13b-chat-hf", LLAMA_2_13B_CHAT_AWQ)
    catalog = load_catalog([directory])
    local = catalog.model(str(directory))
    assert local.weight_bits == 4
    assert local.aliases == ()  # "Llama-2-13b-chat-hf" means the built-in llama-2-13b
    assert catalog.model("Llama-2-13b-chat-hf") == builtin_catalog().model("llama-2-13b")
    assert catalog.model("meta-llama/Llama-2-13b-chat-hf").weight_bits is None
    # A second directory of the same name keeps its path too, without the alias.
    other = model_dir(tmp_path / "b", "my-llama", LLAMA_3_1_8B_INSTRUCT)
    again = model_dir(tmp_path / "c", "my-llama", LLAMA_3_1_8B_INSTRUCT)
    both = load_catalog([other, again])
    assert both.model("my-llama").name == str(other)
    assert both.model(str(again)).aliases == ()


def test_a_toml_entry_named_by_the_path_merges_into_the_config_entry(tmp_path: Path) -> None:
    directory = model_dir(tmp_path, "my-llama", LLAMA_3_1_8B_INSTRUCT)
    toml = tmp_path / "fp8.toml"
    toml.write_text(f'[models."{directory}"]\nweight_bits = 8\n')
    model = load_catalog([directory, toml]).model("my-llama")
    assert model.weight_bits == 8
    assert model.params == spec(LLAMA_3_1_8B_INSTRUCT).params


def test_an_unknown_path_name_reads_the_config_json_it_points_at(tmp_path: Path) -> None:
    directory = model_dir(tmp_path, "Llama-2-13b-chat-hf", LLAMA_2_13B_CHAT_AWQ)
    catalog = builtin_catalog()
    for name in (str(directory), f"{directory}/", f"{directory}/config.json"):
        model = catalog.model(name)
        assert (model.name, model.weight_bits) == (str(directory), 4), name
    assert str(directory) not in catalog.models  # the catalog itself is unchanged
    (directory / "config.json").write_text("{}")
    assert catalog.model(str(directory)).weight_bits == 4  # read once: one plan, one entry
    # Without a config.json there, a path still resolves by its last component.
    assert catalog.model(str(tmp_path / "elsewhere/Llama-2-13b-hf")).name == "llama-2-13b"
    assert catalog.model("meta-llama/Llama-2-13b-chat-hf").name == "llama-2-13b"
    with pytest.raises(CatalogError, match=r"unknown model '/nowhere/my-llama'"):
        catalog.model("/nowhere/my-llama")
    broken = model_dir(tmp_path, "broken", {**LLAMA_3_1_8B_INSTRUCT, "vocab_size": -1})
    with pytest.raises(CatalogError, match=r"broken/config.json: field 'vocab_size'"):
        catalog.model(str(broken))


def test_a_workload_can_name_a_model_directory(tmp_path: Path) -> None:
    directory = model_dir(tmp_path, "my-moe", MIXTRAL_8X7B)
    doc = {"model": [{"name": f"{directory}/", "rate": 2, "input_mean": 500, "output_mean": 100}]}
    (workload,) = parse_workloads(doc, "wl.toml", builtin_catalog())
    assert workload.model == str(directory)
    assert replace(builtin_catalog().model(workload.model), name="x").is_moe
