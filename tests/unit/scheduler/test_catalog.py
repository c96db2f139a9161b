"""Scheduler catalogs: the shipped GPU and model data, user files merged in, and the errors a
bad file gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from fabricnode.errors import ConfigError
from scheduler.catalog import builtin_catalog, load_catalog
from scheduler.errors import CatalogError

REQUIRED_GPUS = (
    "V100-32G",
    "A100-40G",
    "A100-80G",
    "H100-SXM",
    "H100-PCIe",
    "GH200",
    "H200",
    "L40S",
    "RTX-3090",
    "RTX-4090",
    "L4",
    "MI250X",
    "MI300X",
)
REQUIRED_MODELS = (
    "llama-2-7b",
    "llama-2-13b",
    "llama-2-70b",
    "codellama-34b",
    "llama-3.1-8b",
    "llama-3.3-70b",
    "qwen2.5-7b",
    "mixtral-8x7b",
)


def write(tmp_path: Path, text: str, name: str = "extra.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


NEW_GPU = """
[gpus."B200"]
vendor = "NVIDIA"
memory_gb = 180
bf16_tflops = 2250
memory_bw_gbs = 8000
link = "NVLink 5"
link_gbs = 900
link_latency_us = 1.0
gpus_per_node = 8
source = "NVIDIA DGX B200 datasheet"
"""


def test_shipped_catalog_has_the_issue_gpus_and_models_each_with_a_source() -> None:
    catalog = builtin_catalog()
    for name in REQUIRED_GPUS:
        gpu = catalog.gpu(name)
        assert gpu.source.startswith(("NVIDIA", "AMD")), name
        assert "http" in gpu.source, name
    for name in REQUIRED_MODELS:
        assert catalog.model(name).source.startswith("https://huggingface.co/"), name
    assert any(m.is_moe for m in catalog.models.values())
    assert any(m.name.startswith("qwen") and not m.is_moe for m in catalog.models.values())
    gh200 = catalog.gpu("GH200")
    assert (gh200.memory_gb, gh200.memory_bw_gbs) == (96, 4000)


def test_parameter_counts_match_the_published_sizes() -> None:
    catalog = builtin_catalog()
    published_b = {
        "llama-2-7b": 6.74,
        "llama-2-13b": 13.02,
        "llama-2-70b": 68.98,
        "codellama-34b": 33.74,
        "llama-3.1-8b": 8.03,
        "llama-3.3-70b": 70.55,
        "qwen2.5-7b": 7.62,
        "qwen2.5-72b": 72.71,
        "mixtral-8x7b": 46.70,
        "qwen3-30b-a3b": 30.53,
    }
    for name, billions in published_b.items():
        assert catalog.model(name).params / 1e9 == pytest.approx(billions, rel=2e-3), name
    assert catalog.model("mixtral-8x7b").active_params / 1e9 == pytest.approx(12.88, rel=2e-3)
    assert catalog.model("qwen3-30b-a3b").active_params / 1e9 == pytest.approx(3.35, rel=2e-3)


def test_names_resolve_case_insensitively_through_aliases_and_hub_ids() -> None:
    catalog = builtin_catalog()
    assert catalog.gpu("h100").name == "H100-SXM"
    assert catalog.gpu("A100").name == "A100-80G"
    assert catalog.gpu("rtx 3090").name == "RTX-3090"
    assert catalog.gpu("H100-PCIE").name == "H100-PCIe"  # the mesh's hardware name
    assert catalog.model("meta-llama/Llama-3.3-70B-Instruct").name == "llama-3.3-70b"
    assert catalog.model("Llama-2-13b-chat-hf").name == "llama-2-13b"
    assert catalog.model("codellama/CodeLlama-34b-Instruct-hf").name == "codellama-34b"
    assert catalog.model("llama-3-8b").name == "llama-3.1-8b"


def test_unknown_names_list_the_known_ones() -> None:
    catalog = builtin_catalog()
    with pytest.raises(CatalogError, match=r"unknown GPU type 'TPU-v5'.*A100-80G"):
        catalog.gpu("TPU-v5")
    with pytest.raises(CatalogError, match=r"unknown model 'gpt-5'.*llama-2-13b"):
        catalog.model("gpt-5")


def test_user_file_adds_a_gpu_and_a_model(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        NEW_GPU
        + """
[models."tiny-llama"]
layers = 22
hidden = 2048
heads = 32
kv_heads = 4
intermediate = 5632
vocab = 32000
max_context = 2048
tie_embeddings = false
aliases = ["TinyLlama/TinyLlama-1.1B-Chat-v1.0"]
""",
    )
    catalog = load_catalog([path])
    assert catalog.gpu("b200").memory_gb == 180
    tiny = catalog.model("TinyLlama/TinyLlama-1.1B-Chat-v1.0")
    assert tiny.head_dim == 64
    assert tiny.params / 1e9 == pytest.approx(1.1, rel=0.01)
    assert catalog.gpu("H100").name == "H100-SXM"  # built-ins still there
    with pytest.raises(CatalogError):
        builtin_catalog().gpu("B200")  # the shipped catalog is not modified


def test_user_table_with_a_known_name_merges_field_by_field(tmp_path: Path) -> None:
    path = write(tmp_path, '[gpus."H100-SXM"]\nbandwidth_efficiency = 0.9\n')
    h100 = load_catalog([path]).gpu("H100")  # aliases kept
    assert h100.bandwidth_efficiency == 0.9
    assert h100.memory_bw_gbs == builtin_catalog().gpu("H100-SXM").memory_bw_gbs


def test_a_model_entry_can_give_its_weight_width(tmp_path: Path) -> None:
    assert builtin_catalog().model("llama-2-13b").weight_bits is None  # the planner-wide width
    path = write(tmp_path, '[models."llama-2-13b"]\nweight_bits = 4\n')
    awq = load_catalog([path]).model("llama-2-13b")
    assert awq.weight_bits == 4
    assert awq.params == builtin_catalog().model("llama-2-13b").params


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            NEW_GPU.replace("memory_gb = 180\n", ""),
            r"\[gpus.'B200'\] missing required field "
            r"'memory_gb'",
        ),
        (NEW_GPU + "memroy_gb = 1\n", r"unknown field 'memroy_gb'"),
        (NEW_GPU.replace("memory_gb = 180", 'memory_gb = "180"'), r"'memory_gb' must be a number"),
        (NEW_GPU.replace("memory_gb = 180", "memory_gb = -1"), r"must be a positive number"),
        (NEW_GPU.replace("gpus_per_node = 8", "gpus_per_node = 8.5"), r"must be an integer"),
        (NEW_GPU + "compute_efficiency = 1.5\n", r"fraction in \(0, 1\]"),
        (NEW_GPU + 'aliases = ["H100"]\n', r"'H100' is claimed by both 'H100-SXM' and 'B200'"),
        ('[gpu."X"]\nvendor = "x"\n', r"unknown top-level key 'gpu'"),
        ("[gpus\nbroken", r"not valid TOML"),
        (
            '[models."odd"]\nlayers = 2\nhidden = 64\nheads = 6\nkv_heads = 4\n'
            "intermediate = 128\nvocab = 100\nmax_context = 512\n",
            r"hidden 64 is not a multiple of heads 6",
        ),
        (
            '[models."odd"]\nlayers = 2\nhidden = 64\nheads = 8\nkv_heads = 3\n'
            "intermediate = 128\nvocab = 100\nmax_context = 512\n",
            r"heads 8 is not a multiple of kv_heads 3",
        ),
        (
            '[models."moe"]\nlayers = 2\nhidden = 64\nheads = 8\nkv_heads = 8\n'
            "intermediate = 128\nvocab = 100\nmax_context = 512\nexperts = 4\n",
            r"experts_per_token must be from 1 to experts",
        ),
        (
            '[models."llama-2-7b"]\nweight_bits = 3\n',
            r"'weight_bits' must be 4, 8, 16 or 32, got 3",
        ),
        ('[models."llama-2-7b"]\nweight_bits = 4.0\n', r"'weight_bits' must be 4, 8, 16 or 32"),
    ],
)
def test_bad_catalog_file_is_one_clear_error_naming_file_and_table(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(CatalogError, match=message) as info:
        load_catalog([path])
    assert str(info.value).startswith(f"{path}: ")
    assert isinstance(info.value, ConfigError)  # the CLI prints it as one line


def test_missing_catalog_file_is_a_catalog_error(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="cannot read catalog file"):
        load_catalog([tmp_path / "nope.toml"])
