"""Workloads (per-model Poisson arrivals with normal input/output lengths) and inventories.

File formats (``fabric plan``, docs/scheduler.md):

* Inventory (TOML): a ``[gpus]`` table of GPU type to count, ``A100-80G = 24``, or
  ``[[nodes]]`` entries with ``gpu`` (type), ``count`` (nodes), ``gpus`` (per node) and optional
  ``shared`` (several engines may split a node); ``scheduler.inventory`` says what each means.
* Workload (TOML): ``[[model]]`` entries with ``name`` (catalog id), ``rate`` (req/s),
  ``input_mean`` and ``output_mean`` (tokens) and optional ``input_std``, ``output_std`` and
  ``priority`` (default 1: a model's share weighs ``priority`` times when the inventory cannot
  serve every rate).

Lengths are ``round(normal(mean, std))`` clipped to ``[1, max_context - 1]``, input and output
drawn independently; ``LengthStats`` holds the exact moments of that clipped distribution, so the
analytic model and the discrete-event simulator see the same workload.
"""

from __future__ import annotations

import math
import random
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from scheduler.catalog import Catalog
from scheduler.errors import CatalogError, WorkloadError
from scheduler.inventory import Inventory, NodeGroup


@dataclass(frozen=True)
class Workload:
    """One model's traffic: Poisson arrivals at ``rate_rps``, normal lengths in tokens."""

    model: str
    rate_rps: float
    input_mean: float
    output_mean: float
    input_std: float = 0.0
    output_std: float = 0.0
    priority: float = 1.0  # weight of the model's share when the inventory is overloaded

    def __post_init__(self) -> None:
        if not self.rate_rps >= 0 or math.isinf(self.rate_rps):
            raise WorkloadError(f"{self.model}: rate must be zero or more, got {self.rate_rps}")
        if not 0 < self.priority < math.inf:
            raise WorkloadError(f"{self.model}: priority must be positive, got {self.priority}")
        for name in ("input_mean", "output_mean"):
            value = getattr(self, name)
            if not 1 <= value < math.inf:
                raise WorkloadError(f"{self.model}: {name} must be at least 1, got {value}")
        for name in ("input_std", "output_std"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise WorkloadError(f"{self.model}: {name} must be zero or more, got {value}")

    def scaled(self, factor: float) -> Workload:
        """The same lengths at ``factor`` times the rate."""
        return Workload(
            self.model,
            self.rate_rps * factor,
            self.input_mean,
            self.output_mean,
            self.input_std,
            self.output_std,
            self.priority,
        )

    def lengths(self, max_context: int) -> LengthStats:
        """Moments of the clipped length distributions for a model of ``max_context``."""
        return length_stats(
            self.input_mean, self.input_std, self.output_mean, self.output_std, max_context
        )


def sample_length(rng: random.Random, mean: float, std: float, cap: int) -> int:
    """One length: ``round(normal(mean, std))`` clipped to ``[1, cap]``."""
    value = round(rng.gauss(mean, std)) if std > 0 else round(mean)
    return 1 if value < 1 else cap if value > cap else value


def _clipped_moments(mean: float, std: float, cap: int) -> tuple[float, float]:
    """E[X] and E[X^2] of ``sample_length``'s distribution, exactly (sum over integers)."""
    if std <= 0 or cap == 1:
        x = float(min(max(round(mean), 1), cap))
        return x, x * x
    scale = std * math.sqrt(2.0)

    def cdf(x: float) -> float:
        return 0.5 * (1.0 + math.erf((x - mean) / scale))

    # round() sends [n - 0.5, n + 0.5) to n; clipping sends each tail to its end.
    below = cdf(1.5)
    above = 1.0 - cdf(cap - 0.5)
    m1 = below + above * cap
    m2 = below + above * cap * cap
    lo = max(2, math.floor(mean - 9 * std))
    hi = min(cap - 1, math.ceil(mean + 9 * std))
    for n in range(lo, hi + 1):
        p = cdf(n + 0.5) - cdf(n - 0.5)
        m1 += p * n
        m2 += p * n * n
    return m1, m2


@dataclass(frozen=True)
class LengthStats:
    """Moments of a workload's request lengths, as the serving models use them."""

    input_mean: float
    input_sq: float  # E[input^2]
    output_mean: float
    output_sq: float  # E[output^2]

    @property
    def decode_steps(self) -> float:
        """Decode iterations per request: the first token comes from the prefill."""
        return self.output_mean - 1.0

    @property
    def decode_context(self) -> float:
        """Mean cached context over all decode iterations of all requests (longer outputs
        weigh more): E[sum_{j<out-1} (in + j)] / E[out - 1]."""
        steps = self.decode_steps
        if steps <= 0:
            return self.input_mean
        tail = (self.output_sq - 3.0 * self.output_mean + 2.0) / 2.0
        return self.input_mean + tail / steps

    @property
    def prefill_pairs(self) -> float:
        """Mean causal attention pairs of one prompt, E[in (in + 1) / 2]."""
        return (self.input_sq + self.input_mean) / 2.0

    @property
    def kv_tokens(self) -> float:
        """Mean KV tokens a request reserves: input plus output."""
        return self.input_mean + self.output_mean


@cache
def length_stats(
    input_mean: float, input_std: float, output_mean: float, output_std: float, max_context: int
) -> LengthStats:
    cap = max(1, max_context - 1)
    i1, i2 = _clipped_moments(input_mean, input_std, cap)
    o1, o2 = _clipped_moments(output_mean, output_std, cap)
    return LengthStats(i1, i2, o1, o2)


# -- files ------------------------------------------------------------------------------------


def _read_toml(path: str | Path, what: str) -> dict[str, object]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read {what} file: {exc.strerror}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadError(f"{path}: not valid TOML: {exc}") from None


def _number(where: str, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WorkloadError(f"{where}: {key} must be a number, got {value!r}")
    return float(value)


_NODE_KEYS = {"gpu", "count", "gpus", "shared"}


def parse_inventory(doc: Mapping[str, object], origin: str, catalog: Catalog) -> Inventory:
    """The inventory of a document: ``[gpus]`` (GPU type = count) or ``[[nodes]]`` entries
    (``gpu``, ``count`` nodes, ``gpus`` per node, optional ``shared``); see
    ``scheduler.inventory`` for what each form means."""
    unknown = sorted(set(doc) - {"gpus", "nodes"})
    if unknown:
        raise WorkloadError(
            f"{origin}: unknown key {unknown[0]!r} (expected a [gpus] table or [[nodes]] entries)"
        )
    if "gpus" in doc and "nodes" in doc:
        raise WorkloadError(f"{origin}: give either [gpus] or [[nodes]], not both")
    if "nodes" in doc:
        return Inventory.from_groups(_node_groups(doc["nodes"], origin, catalog), catalog)
    table = doc.get("gpus")
    if not isinstance(table, dict) or not table:
        raise WorkloadError(
            f"{origin}: expected a [gpus] table of GPU type = count, or [[nodes]] entries"
        )
    inventory: dict[str, int] = {}
    for name, count in table.items():
        try:
            gpu = catalog.gpu(name)
        except CatalogError as exc:
            raise WorkloadError(f"{origin}: {exc}") from None
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise WorkloadError(f"{origin}: gpus.{name} must be a count (integer >= 0)")
        if gpu.name in inventory:
            raise WorkloadError(f"{origin}: {name!r} and another key both name {gpu.name}")
        inventory[gpu.name] = count
    return Inventory.from_counts(inventory, catalog)


def _node_groups(entries: object, origin: str, catalog: Catalog) -> list[NodeGroup]:
    if not isinstance(entries, list) or not entries:
        raise WorkloadError(f"{origin}: nodes must be one or more [[nodes]] entries")
    groups: list[NodeGroup] = []
    for i, entry in enumerate(entries):
        where = f"{origin}: nodes #{i + 1}"
        if not isinstance(entry, dict):
            raise WorkloadError(f"{where}: must be a table")
        bad = sorted(set(entry) - _NODE_KEYS)
        if bad:
            raise WorkloadError(
                f"{where}: unknown key {bad[0]!r} (known: {', '.join(sorted(_NODE_KEYS))})"
            )
        for key in ("gpu", "count", "gpus"):
            if key not in entry:
                raise WorkloadError(f"{where}: missing {key!r}")
        gpu = entry["gpu"]
        if not isinstance(gpu, str):
            raise WorkloadError(f"{where}: gpu must be a GPU type name")
        try:
            gpu = catalog.gpu(gpu).name
        except CatalogError as exc:
            raise WorkloadError(f"{where}: {exc}") from None
        for key, least in (("count", 0), ("gpus", 1)):
            value = entry[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise WorkloadError(f"{where}: {key} must be an integer >= {least}")
        shared = entry.get("shared", False)
        if not isinstance(shared, bool):
            raise WorkloadError(f"{where}: shared must be true or false")
        groups.append(NodeGroup(gpu, entry["count"], entry["gpus"], shared))
    return groups


def load_inventory(path: str | Path, catalog: Catalog) -> Inventory:
    return parse_inventory(_read_toml(path, "inventory"), str(path), catalog)


_WORKLOAD_KEYS = {
    "name",
    "rate",
    "input_mean",
    "output_mean",
    "input_std",
    "output_std",
    "priority",
}


def parse_workloads(doc: Mapping[str, object], origin: str, catalog: Catalog) -> list[Workload]:
    """One ``Workload`` per ``[[model]]`` entry, names resolved to catalog ids."""
    unknown = sorted(set(doc) - {"model"})
    if unknown:
        raise WorkloadError(f"{origin}: unknown key {unknown[0]!r} (expected [[model]] entries)")
    entries = doc.get("model")
    if not isinstance(entries, list) or not entries:
        raise WorkloadError(f"{origin}: expected one or more [[model]] entries")
    workloads: list[Workload] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"{origin}: model #{i + 1}"
        if not isinstance(entry, dict):
            raise WorkloadError(f"{where}: must be a table")
        bad = sorted(set(entry) - _WORKLOAD_KEYS)
        if bad:
            raise WorkloadError(
                f"{where}: unknown key {bad[0]!r} (known: {', '.join(sorted(_WORKLOAD_KEYS))})"
            )
        for key in ("name", "rate", "input_mean", "output_mean"):
            if key not in entry:
                raise WorkloadError(f"{where}: missing {key!r}")
        name = entry["name"]
        if not isinstance(name, str):
            raise WorkloadError(f"{where}: name must be a string")
        try:
            model = catalog.model(name).name
        except CatalogError as exc:
            raise WorkloadError(f"{where}: {exc}") from None
        if model in seen:
            raise WorkloadError(f"{where}: {model} appears twice")
        seen.add(model)
        values = {k: _number(where, k, v) for k, v in entry.items() if k != "name"}
        workloads.append(
            Workload(
                model,
                values["rate"],
                values["input_mean"],
                values["output_mean"],
                values.get("input_std", 0.0),
                values.get("output_std", 0.0),
                values.get("priority", 1.0),
            )
        )
    return workloads


def load_workloads(path: str | Path, catalog: Catalog) -> list[Workload]:
    return parse_workloads(_read_toml(path, "workload"), str(path), catalog)
