"""The figures of ``bench/router.py``: per target and cell, from the load generator's raw runs.

``summarize`` turns the rounds of every (target, cell) into the table's figures (the module
docstring of ``bench/router.py`` defines each); ``render`` prints the table; ``finite`` makes the
``--json`` document valid JSON. No processes or sockets here: this is arithmetic on results.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

SSE_EVENTS = 18  # 16 content chunks + usage chunk + [DONE], as bench/fake_backend.py sends
# created, in_progress, output_item.added, content_part.added, 16 deltas, output_text.done,
# content_part.done, output_item.done, completed: bench/fake_backend.py's Responses stream
RESPONSES_EVENTS = 24
MODES = ("json", "sse", "audio", "responses-sse")
STREAM_EVENTS = {"sse": SSE_EVENTS, "responses-sse": RESPONSES_EVENTS}


class Target(Protocol):
    """What the report reads of a target: its name, and why it did not run if it did not."""

    @property
    def name(self) -> str: ...

    @property
    def unavailable(self) -> str | None: ...


@dataclass(frozen=True)
class Cell:
    """One concurrency and one mode: ``json`` and ``sse`` (chat completions), ``audio`` (a
    multipart transcription upload), ``responses-sse`` (a streamed Responses request)."""

    concurrency: int
    mode: str

    @property
    def stream(self) -> bool:
        return self.mode in STREAM_EVENTS

    @property
    def label(self) -> str:
        return f"c={self.concurrency} {self.mode}"


def percentile(sorted_values: list[int], q: float) -> float:
    if not sorted_values:
        return math.nan
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return float(sorted_values[k])


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def median(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def others_pct(run: dict[str, Any]) -> float:
    """Share of all CPUs busy with anything but this bench's processes (router, backend,
    client, idle routers of other targets), in %: other work on the machine, kernel softirq."""
    total = run.get("host_total_ticks", 0)
    if not total:
        return math.nan
    ours = sum(run.get("cpu_ticks", {}).values()) + run.get("client_ticks", 0)
    return max(0.0, 100.0 * (run.get("host_busy_ticks", 0) - ours) / total)


def bystanders_pct(run: dict[str, Any]) -> float:
    """Share of all CPUs that the other targets' idle routers used during the window, in %."""
    total = run.get("host_total_ticks", 0)
    ticks = run.get("cpu_ticks", {}).get("bystanders", 0)
    return 100.0 * ticks / total if total else math.nan


def summarize(
    targets: Sequence[Target],
    cells: list[Cell],
    raw: dict[tuple[str, str], list[dict[str, Any]]],
    unsupported: dict[tuple[str, str], str] | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per target, per cell: the figures of the table (see the module docstring).
    ``unsupported`` maps (target, mode) to why that target does not serve the mode."""
    unsupported = unsupported or {}

    def round_means(name: str, label: str) -> dict[int, float]:
        runs = raw.get((name, label), [])
        return {r["round"]: mean(r.get("latencies_us") or []) / 1000.0 for r in runs}

    def per_req(ticks: int, clk: int, completed: int) -> float:
        return ticks * 1000.0 / clk / completed if completed else math.nan

    direct = {c.label: round_means("direct", c.label) for c in cells}
    added: dict[tuple[str, str], dict[int, float]] = {}
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for target in targets:
        per_cell: dict[str, dict[str, Any]] = {}
        for cell in cells:
            runs = raw.get((target.name, cell.label), [])
            lat = sorted(x for r in runs for x in r.get("latencies_us") or [])
            ttft = [x for r in runs for x in r.get("ttft_us") or []]
            completed = sum(r.get("completed", 0) for r in runs)
            clk = runs[0].get("clk_tck", 100) if runs else 100

            def ticks(key: str, runs: list[dict[str, Any]] = runs) -> int:
                return sum(r.get("cpu_ticks", {}).get(key, 0) for r in runs)

            base = direct[cell.label]
            by_round = {
                rnd: m - base[rnd]
                for rnd, m in round_means(target.name, cell.label).items()
                if rnd in base
            }
            added[(target.name, cell.label)] = by_round
            is_router = target.name != "direct"
            per_cell[cell.label] = {
                "unsupported": unsupported.get((target.name, cell.mode)),
                "requests": completed,
                "errors": sum(r.get("errors", 0) for r in runs),
                "error_samples": [s for r in runs for s in r.get("error_samples", [])][:3],
                "fatal": [r["fatal"] for r in runs if "fatal" in r],
                "mean_ms": mean(lat) / 1000.0,
                "p50_ms": percentile(lat, 0.50) / 1000.0,
                "p99_ms": percentile(lat, 0.99) / 1000.0,
                "ttft_mean_ms": mean(ttft) / 1000.0 if cell.stream else math.nan,
                "added_mean_ms": median(list(by_round.values())) if is_router else math.nan,
                "added_mean_ms_by_round": by_round if is_router else {},
                "cpu_ms_per_req": per_req(ticks("router"), clk, completed)
                if is_router
                else math.nan,
                "backend_cpu_ms_per_req": per_req(ticks("backend"), clk, completed),
                "client_cpu_ms_per_req": per_req(
                    sum(r.get("client_ticks", 0) for r in runs), clk, completed
                ),
                "others_cpu_pct": median([others_pct(r) for r in runs]),
                "bystanders_cpu_pct": median([bystanders_pct(r) for r in runs]),
                "req_per_s": median(
                    [r["completed"] / r["window_s"] for r in runs if r.get("window_s")]
                ),
            }
        summary[target.name] = per_cell
    for cell in cells:
        vr = summary.get("vllm-router", {}).get(cell.label, {}).get("added_mean_ms", math.nan)
        json_label = Cell(cell.concurrency, "json").label
        for name, per_cell in summary.items():
            s = per_cell[cell.label]
            ok = vr > 0 and not math.isnan(s["added_mean_ms"])
            s["ratio_vs_vllm_router"] = s["added_mean_ms"] / vr if ok else math.nan
            if cell.stream and name != "direct" and json_label in per_cell:
                sse, plain = added[(name, cell.label)], added[(name, json_label)]
                events = STREAM_EVENTS[cell.mode]
                per_chunk = [(sse[r] - plain[r]) * 1000.0 / events for r in sse if r in plain]
                s["added_us_per_chunk"] = median(per_chunk)
                cpu_sse, cpu_json = s["cpu_ms_per_req"], per_cell[json_label]["cpu_ms_per_req"]
                s["cpu_us_per_chunk"] = (cpu_sse - cpu_json) * 1000.0 / events
    return summary


def finite(value: Any) -> Any:
    """The document with NaN as null (JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def fmt(value: float, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def render(
    targets: Sequence[Target],
    cells: list[Cell],
    summary: dict[str, dict[str, dict[str, Any]]],
    header: list[str],
) -> str:
    cols = [
        ("cell", max(9, *(len(c.label) for c in cells))),
        ("target", 12),
        ("mean ms", 8),
        ("p50 ms", 8),
        ("p99 ms", 8),
        ("+mean ms", 9),
        ("x vllm", 7),
        ("CPU/req ms", 10),
        ("req/s", 8),
        ("TTFT ms", 8),
        ("+us/chunk", 9),
        ("CPU us/chunk", 12),
        ("err", 5),
    ]
    lines = [*header, ""]
    lines.append(
        "  ".join(f"{name:>{w}}" if i > 1 else f"{name:<{w}}" for i, (name, w) in enumerate(cols))
    )
    lines.append("  ".join("-" * w for _, w in cols))
    for cell in cells:
        for target in targets:
            if target.unavailable:
                continue
            s = summary[target.name][cell.label]
            if s.get("unsupported"):
                continue  # listed below the table with the reason
            row = [
                cell.label,
                target.name,
                fmt(s["mean_ms"]),
                fmt(s["p50_ms"]),
                fmt(s["p99_ms"]),
                fmt(s["added_mean_ms"]) if target.name != "direct" else "",
                fmt(s["ratio_vs_vllm_router"], 2) if target.name != "direct" else "",
                fmt(s["cpu_ms_per_req"]) if target.name != "direct" else "",
                fmt(s["req_per_s"], 0),
                fmt(s["ttft_mean_ms"]) if cell.stream else "",
                fmt(s.get("added_us_per_chunk", math.nan), 1)
                if cell.stream and target.name != "direct"
                else "",
                fmt(s.get("cpu_us_per_chunk", math.nan), 1)
                if cell.stream and target.name != "direct"
                else "",
                str(s["errors"]),
            ]
            lines.append(
                "  ".join(
                    f"{v:>{w}}" if i > 1 else f"{v:<{w}}"
                    for i, (v, (_, w)) in enumerate(zip(row, cols, strict=True))
                )
            )
        lines.append("")
    for target in targets:
        if target.unavailable:
            lines.append(f"{target.name}: unavailable: {target.unavailable}")
    noted: set[tuple[str, str]] = set()
    for target in targets:
        for cell in cells:
            if target.unavailable or (target.name, cell.mode) in noted:
                continue
            why = summary[target.name][cell.label].get("unsupported")
            if why:
                noted.add((target.name, cell.mode))
                lines.append(f"{target.name}: unsupported for {cell.mode}: {why}")
    for target in targets:
        for cell in cells:
            if target.unavailable:
                continue
            s = summary[target.name][cell.label]
            if s["error_samples"] or s["fatal"]:
                lines.append(
                    f"{target.name} {cell.label}: {s['errors']} errors, e.g. "
                    f"{(s['fatal'] or s['error_samples'])[0]}"
                )
    return "\n".join(lines).rstrip() + "\n"
