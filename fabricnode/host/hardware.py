"""GPU discovery: what accelerators this job may use, in the registry's catalogue names.

Theory of operation
-------------------
``discover`` runs ``nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader,
nounits`` (through an injectable ``Runner``), parses its lines (``parse_nvidia_smi``), keeps the
devices this job may use (``visible_devices`` + ``select_visible``) and summarises them
(``summarise``) as a ``GpuInventory``: catalogue type (``normalise_gpu_name``), count, memory per
GPU and host. Everything but ``discover``'s default runner is pure.

Visibility. ``CUDA_VISIBLE_DEVICES`` wins (it is what the engine will see), then
``SLURM_STEP_GPUS``, then ``SLURM_JOB_GPUS``. Entries are indices or UUIDs (``GPU-…``, a unique
prefix is enough, as in CUDA); ``""`` or ``NoDevFiles`` mean no GPU. CUDA stops at the first
invalid entry, and so do we. Inside a device cgroup ``nvidia-smi`` lists only the job's GPUs,
renumbered from 0, while ``SLURM_JOB_GPUS`` keeps the node's numbering: when some indices do not
match but ``nvidia-smi`` lists exactly as many GPUs as were named, all of them are taken.

No GPU (``nvidia-smi`` missing, failing, or nothing visible) is a normal answer, never an error:
``GpuInventory.none(host)``. ``--sim-gpu TYPE[:COUNT[:MEMORY_GB]]`` (``parse_sim_gpu``) replaces
discovery for the simulated engine.
"""

from __future__ import annotations

import re
import socket
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from fabricnode.errors import ConfigError
from fabricnode.host.hostcmd import Runner, run_command
from fabricnode.mesh.registry import Hardware

NVIDIA_SMI_ARGV = (
    "nvidia-smi",
    "--query-gpu=index,uuid,name,memory.total",
    "--format=csv,noheader,nounits",
)
VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")
NO_DEVICES = "NoDevFiles"

# Memory per GPU (GB, as catalogued) for --sim-gpu TYPE without an explicit memory.
KNOWN_MEMORY_GB: dict[str, float] = {
    "H100": 80.0,
    "H100-PCIE": 80.0,
    "H100-NVL": 94.0,
    "H200": 141.0,
    "H200-NVL": 141.0,
    "GH200": 96.0,
    "B200": 180.0,
    "A100-80G": 80.0,
    "A100-40G": 40.0,
    "L40S": 48.0,
    "L40": 48.0,
    "L4": 24.0,
    "A10": 24.0,
    "A10G": 24.0,
    "A40": 48.0,
    "T4": 16.0,
    "RTX-3090": 24.0,
    "RTX-4090": 24.0,
    "cpu": 0.0,
}


@dataclass(frozen=True)
class Gpu:
    """One line of nvidia-smi: index, UUID, marketing name and total memory in MiB."""

    index: int
    uuid: str
    name: str
    memory_mib: float

    @property
    def gpu_type(self) -> str:
        return normalise_gpu_name(self.name, self.memory_mib)


@dataclass(frozen=True)
class GpuInventory:
    """The accelerators of this node as the registry shows them.

    ``gpu_type`` is the most common catalogue type among the visible GPUs (``mixed`` tells
    whether there was more than one), ``gpu_memory_gb`` the smallest memory of one GPU in GiB
    rounded to 0.1 (as catalogued for simulated GPUs), ``gpus`` the devices behind the summary.
    """

    gpu_type: str
    gpu_count: int
    gpu_memory_gb: float
    host: str
    gpus: tuple[Gpu, ...] = ()
    simulated: bool = False

    @classmethod
    def none(cls, host: str) -> GpuInventory:
        return cls("", 0, 0.0, host)

    @property
    def mixed(self) -> bool:
        return len({g.gpu_type for g in self.gpus}) > 1

    def to_hardware(self) -> Hardware:
        return Hardware(self.gpu_type, self.gpu_count, self.gpu_memory_gb, self.host)


# -- nvidia-smi --------------------------------------------------------------------------------


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """GPUs from ``--format=csv,noheader,nounits`` output; lines that do not parse are skipped
    (error messages, ``[N/A]`` indices); unparseable memory becomes 0."""
    gpus = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4:
            continue
        index_text, uuid, memory_text = fields[0], fields[1], fields[-1]
        name = ", ".join(fields[2:-1])  # a name with a comma in it stays whole
        if not index_text.isdigit() or not name:
            continue
        gpus.append(Gpu(int(index_text), uuid, name, _memory_mib(memory_text)))
    return gpus


def _memory_mib(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(?:\s*MiB)?", text)
    return float(match.group(1)) if match else 0.0


_PREFIXES = ("NVIDIA ", "Tesla ", "GeForce ", "Quadro ")


def normalise_gpu_name(name: str, memory_mib: float | None = None) -> str:
    """The catalogue type of an nvidia-smi name (``NVIDIA A100-SXM4-80GB`` → ``A100-80G``), or
    the name itself, stripped, when it is not one we know. ``memory_mib`` picks the memory
    variant when the name does not say it."""
    raw = " ".join(name.split())
    short = raw
    stripped = True
    while stripped:
        stripped = False
        for prefix in _PREFIXES:
            if short.upper().startswith(prefix.upper()):
                short, stripped = short[len(prefix) :], True
    up = short.upper()
    tokens = re.split(r"[\s\-_]+", up)
    first = tokens[0] if tokens else ""
    size = _size_gb(up)

    if first in ("GH200", "GB200", "GB300"):
        return first
    if first in ("H100", "H200", "H800", "H20", "B200", "B100", "B300"):
        if "NVL" in tokens:
            return f"{first}-NVL"
        if "PCIE" in tokens:
            return f"{first}-PCIE"
        return first
    if first in ("A100", "A800"):
        if size is None and memory_mib:
            size = 80 if memory_mib > 60 * 1024 else 40
        return f"{first}-{size}G" if size else first
    if first == "V100" or first.startswith("V100S"):
        if size is None and memory_mib:
            size = 32 if memory_mib > 20 * 1024 else 16
        return f"{first}-{size}G" if size else first
    if first == "RTX":
        rest = [t for t in tokens[1:] if t not in ("GENERATION",)]
        return "-".join(["RTX", *rest]) if rest else raw
    if re.fullmatch(r"(A\d{1,2}G?|L\d{1,2}S?|T4|P100|P40|K80|MI\d+X?)", first):
        return first
    return raw


def _size_gb(upper_name: str) -> int | None:
    match = re.search(r"(\d+)\s*GB\b", upper_name)
    return int(match.group(1)) if match else None


# -- visibility --------------------------------------------------------------------------------


def visible_devices(env: Mapping[str, str]) -> tuple[str, ...] | None:
    """The devices this job may use as named by the environment (indices or UUIDs), ``()`` for
    none, None when nothing restricts them."""
    for var in VISIBILITY_VARS:
        value = env.get(var)
        if value is None:
            continue
        value = value.strip()
        if value in ("", NO_DEVICES):
            return ()
        if var == "CUDA_VISIBLE_DEVICES":
            return _cuda_list(value)
        return _slurm_list(value)
    return None


def _cuda_list(value: str) -> tuple[str, ...]:
    out: list[str] = []
    for item in (i.strip() for i in value.split(",")):
        if item.isdigit() or item.upper().startswith(("GPU-", "MIG-")):
            out.append(item)
        else:
            break  # CUDA ignores everything from the first invalid entry on (e.g. "-1")
    return tuple(out)


def _slurm_list(value: str) -> tuple[str, ...]:
    out: list[str] = []
    for item in (i.strip() for i in value.split(",")):
        range_match = re.fullmatch(r"(\d+)-(\d+)", item)
        if range_match and int(range_match.group(1)) <= int(range_match.group(2)) < 4096:
            out.extend(str(i) for i in range(int(range_match[1]), int(range_match[2]) + 1))
        elif item.isdigit() or item.upper().startswith(("GPU-", "MIG-")):
            out.append(item)
    return tuple(out)


def select_visible(gpus: Sequence[Gpu], visible: Sequence[str] | None) -> list[Gpu]:
    """The GPUs named by ``visible`` (see the module docstring for the cgroup rule)."""
    if visible is None:
        return list(gpus)
    chosen: list[Gpu] = []
    unmatched_index = False
    for item in visible:
        if item.isdigit():
            found = [g for g in gpus if g.index == int(item)]
            unmatched_index = unmatched_index or not found
        else:
            found = [g for g in gpus if g.uuid.upper().startswith(item.upper())]
            if len(found) > 1:  # an ambiguous UUID prefix names no device
                found = []
        for gpu in found:
            if gpu not in chosen:
                chosen.append(gpu)
    if unmatched_index and len(gpus) == len(visible):
        return list(gpus)
    return chosen


# -- summary and discovery ---------------------------------------------------------------------


def summarise(gpus: Iterable[Gpu], host: str) -> GpuInventory:
    """One inventory for ``gpus`` (most common type, smallest memory)."""
    chosen = tuple(gpus)
    if not chosen:
        return GpuInventory.none(host)
    types = Counter(g.gpu_type for g in chosen)
    gpu_type = max(types, key=lambda t: (types[t], -_first_position(chosen, t)))
    memory_gb = round(min(g.memory_mib for g in chosen) / 1024.0, 1)
    return GpuInventory(gpu_type, len(chosen), memory_gb, host, chosen)


def _first_position(gpus: Sequence[Gpu], gpu_type: str) -> int:
    return next(i for i, g in enumerate(gpus) if g.gpu_type == gpu_type)


def parse_sim_gpu(spec: str, host: str) -> GpuInventory:
    """``TYPE[:COUNT[:MEMORY_GB]]`` (``H100:8``, ``A100-40G``, ``RTX-3090:2:24``)."""
    parts = [p.strip() for p in spec.split(":")]
    if not parts[0] or len(parts) > 3:
        raise ConfigError(f"--sim-gpu {spec!r}: expected TYPE[:COUNT[:MEMORY_GB]], e.g. H100:8")
    gpu_type = parts[0]
    count = 1
    if len(parts) > 1:
        if not parts[1].isdigit() or not 0 < int(parts[1]) <= 4096:
            raise ConfigError(f"--sim-gpu {spec!r}: GPU count must be an integer from 1 to 4096")
        count = int(parts[1])
    known = {k.lower(): v for k, v in KNOWN_MEMORY_GB.items()}
    memory_gb = known.get(gpu_type.lower(), 0.0)
    if len(parts) > 2:
        try:
            memory_gb = float(parts[2])
        except ValueError:
            memory_gb = -1.0
        if not 0 <= memory_gb <= 1e6:
            raise ConfigError(f"--sim-gpu {spec!r}: memory must be a number of GB")
    return GpuInventory(gpu_type, count, memory_gb, host, simulated=True)


def discover(
    env: Mapping[str, str],
    run: Runner = run_command,
    *,
    host: str | None = None,
    sim_gpu: str | None = None,
) -> GpuInventory:
    """This job's GPUs: ``sim_gpu`` if given, else nvidia-smi restricted to the visible devices;
    no GPU when nvidia-smi is missing or fails. Blocks while nvidia-smi runs (see hostcmd)."""
    host = host if host is not None else default_host(env)
    if sim_gpu is not None:
        return parse_sim_gpu(sim_gpu, host)
    visible = visible_devices(env)
    if visible == ():
        return GpuInventory.none(host)
    output = run(NVIDIA_SMI_ARGV)
    if output is None:
        return GpuInventory.none(host)
    return summarise(select_visible(parse_nvidia_smi(output), visible), host)


def default_host(env: Mapping[str, str]) -> str:
    """Slurm's name for this node if set, else the host name."""
    return env.get("SLURMD_NODENAME") or socket.gethostname()
