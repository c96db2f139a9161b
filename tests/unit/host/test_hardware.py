"""GPU discovery from nvidia-smi text and the job's environment (no GPU needed)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from fabricnode.errors import ConfigError
from fabricnode.host.hardware import (
    NVIDIA_SMI_ARGV,
    Gpu,
    GpuInventory,
    discover,
    normalise_gpu_name,
    parse_nvidia_smi,
    parse_sim_gpu,
    select_visible,
    summarise,
    visible_devices,
)
from fabricnode.host.hostcmd import Runner, run_command
from fabricnode.mesh.registry import Hardware

# `nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader,nounits` on a
# 4 x H100 SXM node.
H100_NODE = """\
0, GPU-8c3a1f52-6e2b-4d1a-9b0e-2f1c3d4e5f60, NVIDIA H100 80GB HBM3, 81559
1, GPU-1b2c3d4e-5f60-4a1b-8c2d-3e4f5a6b7c8d, NVIDIA H100 80GB HBM3, 81559
2, GPU-9f8e7d6c-5b4a-4938-8271-605f4e3d2c1b, NVIDIA H100 80GB HBM3, 81559
3, GPU-0a1b2c3d-4e5f-4607-8819-2a3b4c5d6e7f, NVIDIA H100 80GB HBM3, 81559
"""

A100_PCIE_NODE = """\
0, GPU-4f0c5b8e-2d3a-11eb-9c1d-0242ac130003, NVIDIA A100-PCIE-40GB, 40960
1, GPU-5a1d6c9f-2d3a-11eb-9c1d-0242ac130003, NVIDIA A100-PCIE-40GB, 40960
"""

DRIVER_FAILURE = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
    "that the latest NVIDIA driver is installed and running.\n"
)


def fake_run(output: str | None) -> tuple[list[Sequence[str]], Runner]:
    calls: list[Sequence[str]] = []

    def run(argv: Sequence[str]) -> str | None:
        calls.append(tuple(argv))
        return output

    return calls, run


# -- parsing -------------------------------------------------------------------------------------


def test_nvidia_smi_lines_parse_into_gpus() -> None:
    gpus = parse_nvidia_smi(H100_NODE)
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert gpus[0] == Gpu(
        0, "GPU-8c3a1f52-6e2b-4d1a-9b0e-2f1c3d4e5f60", "NVIDIA H100 80GB HBM3", 81559.0
    )


def test_nvidia_smi_error_text_and_na_fields_yield_no_gpus() -> None:
    assert parse_nvidia_smi(DRIVER_FAILURE) == []
    assert parse_nvidia_smi("") == []
    assert parse_nvidia_smi("[N/A], GPU-x, NVIDIA H100 80GB HBM3, 81559\n") == []


def test_unreadable_memory_becomes_zero_and_windows_line_ends_are_fine() -> None:
    gpus = parse_nvidia_smi("0, GPU-a, NVIDIA L40S, [N/A]\r\n1, GPU-b, NVIDIA L40S, 46068\r\n")
    assert [(g.index, g.memory_mib) for g in gpus] == [(0, 0.0), (1, 46068.0)]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 PCIe", "H100-PCIE"),
        ("NVIDIA H100 NVL", "H100-NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA A100-SXM4-80GB", "A100-80G"),
        ("NVIDIA A100-SXM4-40GB", "A100-40G"),
        ("NVIDIA A100-PCIE-40GB", "A100-40G"),
        ("NVIDIA A100 80GB PCIe", "A100-80G"),
        ("Tesla V100-SXM2-32GB", "V100-32G"),
        ("Tesla T4", "T4"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA GeForce RTX 3090", "RTX-3090"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("NVIDIA GeForce RTX 3090 Ti", "RTX-3090-TI"),
        ("NVIDIA RTX A6000", "RTX-A6000"),
        ("NVIDIA RTX 6000 Ada Generation", "RTX-6000-ADA"),
        ("Quadro RTX 8000", "RTX-8000"),
        ("NVIDIA Graphics Device", "NVIDIA Graphics Device"),
        ("  Some  Future   GPU ", "Some Future GPU"),
    ],
)
def test_marketing_names_map_to_catalogue_types(name: str, expected: str) -> None:
    assert normalise_gpu_name(name) == expected


def test_a100_without_size_in_name_is_sized_by_memory() -> None:
    assert normalise_gpu_name("NVIDIA A100", 81920) == "A100-80G"
    assert normalise_gpu_name("NVIDIA A100", 40960) == "A100-40G"
    assert normalise_gpu_name("NVIDIA A100") == "A100"


# -- visibility ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"CUDA_VISIBLE_DEVICES": "0,2"}, ("0", "2")),
        ({"CUDA_VISIBLE_DEVICES": ""}, ()),
        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, ()),
        ({"CUDA_VISIBLE_DEVICES": "1,-1,2"}, ("1",)),
        ({"CUDA_VISIBLE_DEVICES": "GPU-8c3a1f52"}, ("GPU-8c3a1f52",)),
        ({"SLURM_STEP_GPUS": "2,3", "SLURM_JOB_GPUS": "0,1,2,3"}, ("2", "3")),
        ({"SLURM_JOB_GPUS": "0-2,5"}, ("0", "1", "2", "5")),
        ({"SLURM_JOB_GPUS": "NoDevFiles"}, ()),
        ({"CUDA_VISIBLE_DEVICES": "0", "SLURM_JOB_GPUS": "3"}, ("0",)),
    ],
)
def test_visible_devices_follow_cuda_then_step_then_job(
    env: dict[str, str], expected: tuple[str, ...] | None
) -> None:
    assert visible_devices(env) == expected


def test_visible_indices_select_those_gpus() -> None:
    gpus = parse_nvidia_smi(H100_NODE)
    assert [g.index for g in select_visible(gpus, ("1", "3"))] == [1, 3]
    assert select_visible(gpus, None) == gpus
    assert select_visible(gpus, ()) == []


def test_visible_uuid_prefix_selects_one_gpu_and_ambiguous_prefix_none() -> None:
    gpus = parse_nvidia_smi(H100_NODE)
    assert [g.index for g in select_visible(gpus, ("GPU-9f8e7d6c",))] == [2]
    assert [g.index for g in select_visible(gpus, ("gpu-9F8E7D6C-5b4a",))] == [2]
    assert select_visible(gpus, ("GPU-",)) == []


def test_cgroup_renumbered_gpus_are_taken_when_counts_match() -> None:
    # SLURM_JOB_GPUS=2,3 (node numbering) but nvidia-smi in the job's cgroup shows 0 and 1.
    shown = parse_nvidia_smi(H100_NODE)[:2]
    assert select_visible(shown, ("2", "3")) == shown
    # If counts differ, only real matches count.
    assert select_visible(parse_nvidia_smi(H100_NODE), ("3", "7")) == [
        parse_nvidia_smi(H100_NODE)[3]
    ]


# -- summary -------------------------------------------------------------------------------------


def test_summary_reports_type_count_and_memory_in_gib() -> None:
    inv = summarise(parse_nvidia_smi(H100_NODE), "gpu-node-07")
    assert (inv.gpu_type, inv.gpu_count, inv.gpu_memory_gb) == ("H100", 4, 79.6)
    assert inv.to_hardware() == Hardware("H100", 4, 79.6, "gpu-node-07")
    assert not inv.mixed


def test_mixed_node_reports_majority_type_and_smallest_memory() -> None:
    text = (
        "0, GPU-a, NVIDIA GeForce RTX 3090, 24576\n"
        "1, GPU-b, NVIDIA A100-PCIE-40GB, 40960\n"
        "2, GPU-c, NVIDIA A100-PCIE-40GB, 40960\n"
    )
    inv = summarise(parse_nvidia_smi(text), "h")
    assert (inv.gpu_type, inv.gpu_count, inv.gpu_memory_gb, inv.mixed) == (
        "A100-40G",
        3,
        24.0,
        True,
    )


def test_no_gpus_summarise_to_none() -> None:
    assert summarise([], "h") == GpuInventory.none("h") == GpuInventory("", 0, 0.0, "h")


# -- discover ------------------------------------------------------------------------------------


def test_discover_runs_nvidia_smi_and_restricts_to_the_job() -> None:
    calls, run = fake_run(H100_NODE)
    inv = discover({"CUDA_VISIBLE_DEVICES": "0,1"}, run, host="n1")
    assert calls == [NVIDIA_SMI_ARGV]
    assert (inv.gpu_type, inv.gpu_count, inv.host) == ("H100", 2, "n1")


def test_discover_without_nvidia_smi_reports_no_gpu() -> None:
    _, run = fake_run(None)
    assert discover({}, run, host="n1") == GpuInventory.none("n1")


def test_discover_with_failing_driver_output_reports_no_gpu() -> None:
    _, run = fake_run(DRIVER_FAILURE)
    assert discover({}, run, host="n1").gpu_count == 0


def test_discover_with_no_visible_devices_does_not_run_nvidia_smi() -> None:
    calls, run = fake_run(H100_NODE)
    inv = discover({"SLURM_JOB_GPUS": ""}, run, host="n1")
    assert inv.gpu_count == 0 and calls == []


def test_discover_default_host_is_slurm_node_name() -> None:
    _, run = fake_run(A100_PCIE_NODE)
    inv = discover({"SLURMD_NODENAME": "gpu-a-12"}, run)
    assert (inv.host, inv.gpu_type, inv.gpu_count, inv.gpu_memory_gb) == (
        "gpu-a-12",
        "A100-40G",
        2,
        40.0,
    )


def test_discover_on_this_machine_never_raises() -> None:
    inv = discover({}, host="here")
    assert inv.gpu_count >= 0 and inv.host == "here"


def test_missing_command_runs_to_none() -> None:
    assert run_command(["fabric-no-such-command-xyz"]) is None
    assert run_command(["false"]) is None
    assert run_command(["echo", "hi"]) == "hi\n"


# -- simulated GPUs ------------------------------------------------------------------------------


def test_sim_gpu_override_replaces_discovery() -> None:
    calls, run = fake_run(H100_NODE)
    inv = discover({}, run, host="n1", sim_gpu="A100-40G:2")
    assert calls == []
    assert (inv.gpu_type, inv.gpu_count, inv.gpu_memory_gb, inv.simulated) == (
        "A100-40G",
        2,
        40.0,
        True,
    )


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("H100", ("H100", 1, 80.0)),
        ("h100:8", ("h100", 8, 80.0)),
        ("RTX-3090:2:24", ("RTX-3090", 2, 24.0)),
        ("Unknown-X:1:12.5", ("Unknown-X", 1, 12.5)),
        ("Unknown-X", ("Unknown-X", 1, 0.0)),
    ],
)
def test_sim_gpu_spec_parses(spec: str, expected: tuple[str, int, float]) -> None:
    inv = parse_sim_gpu(spec, "h")
    assert (inv.gpu_type, inv.gpu_count, inv.gpu_memory_gb) == expected


@pytest.mark.parametrize("spec", ["", ":2", "H100:0", "H100:two", "H100:1:lots", "H100:1:2:3"])
def test_bad_sim_gpu_spec_is_a_config_error(spec: str) -> None:
    with pytest.raises(ConfigError, match="--sim-gpu"):
        parse_sim_gpu(spec, "h")
