"""Workload and inventory files (the formats in docs/scheduler.md), length moments, and the
placement constraints C1-C3."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from scheduler.catalog import builtin_catalog
from scheduler.errors import WorkloadError
from scheduler.placement import Allocation, Placement, check_placement
from scheduler.workload import Workload, load_inventory, load_workloads, sample_length

CATALOG = builtin_catalog()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "file.toml"
    path.write_text(text)
    return path


def test_inventory_file_maps_catalog_gpu_types_to_counts(tmp_path: Path) -> None:
    path = write(tmp_path, '[gpus]\nA100-80G = 24\n"gh200" = 32\n')
    assert load_inventory(path, CATALOG).counts() == {"A100-80G": 24, "GH200": 32}


def test_workload_file_resolves_models_and_reads_optional_stds(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[[model]]
name = "llama-2-13b"
rate = 110
input_mean = 600
output_mean = 64
input_std = 200

[[model]]
name = "meta-llama/Llama-3.3-70B-Instruct"
rate = 221.5
input_mean = 850
output_mean = 530
""",
    )
    first, second = load_workloads(path, CATALOG)
    assert first == Workload("llama-2-13b", 110.0, 600.0, 64.0, 200.0, 0.0)
    assert second.model == "llama-3.3-70b"
    assert second.rate_rps == 221.5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[gpus]\nTPU = 4\n", r"unknown GPU type 'TPU'"),
        ("[gpus]\nH100 = -1\n", r"gpus.H100 must be a count"),
        ("[gpus]\nH100 = 1\nH100-SXM = 2\n", r"both name H100-SXM"),
        ("gpus = 3\n", r"expected a \[gpus\] table"),
    ],
)
def test_bad_inventory_is_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        load_inventory(write(tmp_path, text), CATALOG)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('name = "llama-2-13b"\nrate = 1\ninput_mean = 600\n', r"model #1: missing 'output_mean'"),
        ('name = "nope"\nrate = 1\ninput_mean = 1\noutput_mean = 1\n', r"unknown model 'nope'"),
        ('name = "llama-2-13b"\nrate = -1\ninput_mean = 1\noutput_mean = 1\n', r"rate must be"),
        ('name = "llama-2-13b"\nrate = 1\ninput_mean = 0\noutput_mean = 1\n', r"input_mean must"),
        ('name = "llama-2-13b"\nrate = "1"\ninput_mean = 1\noutput_mean = 1\n', r"rate must be a"),
        ('name = "llama-2-13b"\nrat = 1\ninput_mean = 1\noutput_mean = 1\n', r"unknown key 'rat'"),
    ],
)
def test_bad_workload_is_one_clear_error(tmp_path: Path, entry: str, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        load_workloads(write(tmp_path, "[[model]]\n" + entry), CATALOG)


def test_missing_file_is_a_workload_error(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="cannot read workload file"):
        load_workloads(tmp_path / "nope.toml", CATALOG)


def test_length_moments_are_those_of_the_sampled_clipped_normal() -> None:
    w = Workload("llama-2-13b", 1, 600, 64, 300, 100)  # output heavily clipped at 1
    stats = w.lengths(4096)
    rng = random.Random(3)
    ins = [sample_length(rng, 600, 300, 4095) for _ in range(50_000)]
    outs = [sample_length(rng, 64, 100, 4095) for _ in range(50_000)]
    assert stats.input_mean == pytest.approx(sum(ins) / len(ins), rel=0.01)
    assert stats.output_mean == pytest.approx(sum(outs) / len(outs), rel=0.02)
    assert stats.output_sq == pytest.approx(sum(o * o for o in outs) / len(outs), rel=0.03)
    assert stats.output_mean > 64  # clipping at 1 raises the mean
    fixed = Workload("llama-2-13b", 1, 600, 64).lengths(4096)
    assert (fixed.input_mean, fixed.output_mean, fixed.decode_steps) == (600, 64, 63)
    assert fixed.decode_context == pytest.approx(600 + 62 / 2)  # mean of 600..662


INVENTORY = {"A100-80G": 24, "GH200": 32}


def test_paper_memp_placement_satisfies_c1_to_c3() -> None:
    memp = Placement.of(
        [
            Allocation("llama-2-13b", "A100-80G", 1, 4),
            Allocation("codellama-34b", "A100-80G", 2, 8),
            Allocation("llama-3.3-70b", "GH200", 4, 8),
            Allocation("llama-3.3-70b", "A100-80G", 4, 1),
        ]
    )
    workloads = [
        Workload("llama-2-13b", 110, 600, 64),
        Workload("codellama-34b", 185.5, 1170, 250),
        Workload("llama-3.3-70b", 221, 850, 530),
    ]
    check_placement(memp, INVENTORY, CATALOG, workloads)
    assert memp.gpus_used() == {"A100-80G": 24, "GH200": 32}


@pytest.mark.parametrize(
    ("allocation", "message"),
    [
        (Allocation("llama-2-13b", "A100-80G", 1, 25), r"C1: 25 A100-80G GPUs allocated, 24"),
        (Allocation("llama-2-13b", "H100", 1, 1), r"C1: 1 H100-SXM GPUs allocated, 0 available"),
        (Allocation("llama-3.3-70b", "A100-80G", 1, 1), r"C2: .*weights need"),
        (Allocation("qwen2.5-7b", "A100-80G", 8, 1), r"C3: .*28 attention heads"),
        (Allocation("llama-2-13b", "GH200", 8, 1), r"C3: .*exceeds 4 GPUs per node"),
    ],
)
def test_placement_violations_name_the_constraint(allocation: Allocation, message: str) -> None:
    workloads = [Workload(allocation.model, 1, 600, 200)]
    with pytest.raises(WorkloadError, match=message):
        check_placement(Placement.of([allocation]), INVENTORY, CATALOG, workloads)
