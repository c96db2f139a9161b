"""Where requests wait inside the simulated engines: a summary of their step logs
(``python -m fabricnode.simengine --step-log PATH``; ``bench/tiers.py --step-log DIR`` writes one
per node and prints this after each cell).

Per log: the priority-0 (interactive) admissions and how long they queued in the engine (p50,
p95); for those that queued at least ``--slow-s``, the engine time they spent waiting, split by
what the steps in between did (admitted a batch prompt, i.e. a priority > 0 one; admitted
interactive prompts only; only decoded) and how much of it was in steps with the KV cache at
least 90% full; how many batch prompts a step that admitted any held on average; how long batch
prompts queued (p50, p90); the mean KV use.

    python bench/steplog.py /tmp/steps/tiered@16-n0.jsonl /tmp/steps/tiered@16-n1.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from statistics import mean
from typing import Any

FULL_KV = 0.9


def percentile(values: list[float], q: float) -> float:
    """The value at rank ``int(q * n)`` of the sorted values; NaN for none (``bench/tiers.py``
    reports its latencies by this too)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _kind(step: dict[str, Any]) -> str:
    admitted = step["admitted"]
    if any(row[0] > 0 for row in admitted):
        return "batch prompt"
    return "interactive prompts" if admitted else "decode only"


def summarize(path: Path, *, skip_s: float = 30.0, slow_s: float = 0.25) -> list[str]:
    """Lines describing one step log, from ``skip_s`` after its first step."""
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not steps:
        return [f"{path.name}: no steps"]
    t0 = steps[0]["t"]
    steps = [s for s in steps if s["t"] - t0 >= skip_s]
    if not steps:
        return [f"{path.name}: no steps after {skip_s:g} s"]
    waits = [(row[2], i) for i, s in enumerate(steps) for row in s["admitted"] if row[0] == 0]
    batch_waits = [row[2] for s in steps for row in s["admitted"] if row[0] > 0]
    spent = dict.fromkeys(("batch prompt", "interactive prompts", "decode only"), 0.0)
    full = 0.0
    for waited, i in waits:
        if waited < slow_s:
            continue
        start = steps[i]["t"] - waited
        for s in steps[:i]:
            if s["t"] + s["duration_s"] <= start:
                continue
            spent[_kind(s)] += s["duration_s"]
            if s["kv_usage"] >= FULL_KV:
                full += s["duration_s"]
    batch_steps = [s for s in steps if _kind(s) == "batch prompt"]
    queued = [w for w, _ in waits]
    lines = [
        f"{path.name}: {len(steps)} steps; interactive admissions {len(waits)}, queued in the "
        f"engine p50 {percentile(queued, 0.5):.3f} s, p95 {percentile(queued, 0.95):.3f} s; "
        f"mean KV use {mean(s['kv_usage'] for s in steps):.2f}",
        f"  interactive requests queued >= {slow_s:g} s: "
        + ", ".join(f"{kind} steps {t:.1f} s" for kind, t in spent.items())
        + f"; in steps with KV >= {FULL_KV:.0%}: {full:.1f} s",
    ]
    if batch_steps:
        per_step = mean(sum(1 for row in s["admitted"] if row[0] > 0) for s in batch_steps)
        lines.append(
            f"  steps admitting batch prompts: {len(batch_steps)}, {per_step:.2f} prompts and "
            f"{mean(s['prefill_tokens'] for s in batch_steps):.0f} prefill tokens each; batch "
            f"prompts queued p50 {percentile(batch_waits, 0.5):.3f} s, "
            f"p90 {percentile(batch_waits, 0.9):.3f} s"
        )
    return lines


def summarize_all(paths: Iterable[Path], *, skip_s: float = 30.0) -> list[str]:
    return [line for path in paths for line in summarize(path, skip_s=skip_s)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--skip-s", type=float, default=30.0, help="warm-up left out (30)")
    args = p.parse_args()
    print("\n".join(summarize_all(args.logs, skip_s=args.skip_s)))


if __name__ == "__main__":
    main()
