"""Priority tiers on real agents: interactive traffic replayed from the Azure trace, with and
without a batch of 20,000 requests worked on the same simulated nodes.

Every cell starts a fresh local mesh (``LocalMesh``): ``--nodes`` serving agents, each
supervising a simulated engine (``python -m fabricnode.simengine``, the ``--gpu`` profile, an
8B model), plus one ingress agent without an engine. Interactive clients replay a slice of the
Azure LLM conversation trace *open loop*: each request is sent at its trace time divided by
``--pace`` (the engines run ``--speed`` = pace, so the load on them is the trace's), as a
streamed chat completion with the trace's prompt length (words of a seeded vocabulary: the
simulated engine counts a word as a token) and ``max_tokens`` = the trace's output length.

Cells:

  interactive  the replay alone: the latency the interactive users get on an otherwise idle
               fabric
  tiered       the replay, and a ``--batch-lines`` batch submitted through the Batch API at the
               start (the ingress's worker sends ``--batch-concurrency`` lines at once, as
               batch-tier requests; the engines schedule by priority when they can). Lines are
               drawn from the same trace's lengths. ``tiered@N``: the same with the batch tier's
               per-node cap (``--batch-max-inflight-per-node``) at N instead of its default;
               ``tiered@N/R``: and pacing at R prompt tokens/s per node
               (``--batch-prefill-rate``); ``tiered@N+kvK``: and the batch tier's KV
               threshold at K (``--batch-kv-threshold``, 0.7 by default)
  greedy       the replay, and the same lines sent by ``--batch-concurrency`` closed-loop
               clients as ordinary requests: what a researcher's own client loop does today.
               Its batch throughput is the capacity the interactive load leaves idle (the batch
               takes all of it, whatever that costs the interactive users)
  batch-only   the batch through the Batch API with no interactive load (not run by default)

Reported per cell, over the measured window (after ``--warmup-s``, to the end of the replay):
interactive requests, their TTFT p50/p95 and end-to-end p95 at the client (seconds), errors,
batch lines completed per second, batch output tokens per second, and how busy the host's CPUs
were (every process of the cell shares them: near 100% the figures measure the host, not the
fabric). Targets (issue 24):
tiered TTFT p95 <= 1.1 x interactive TTFT p95, and tiered batch lines/s >= 70% of greedy's.

    python bench/tiers.py                           # 3 cells, about 14 minutes
    python bench/tiers.py --cells interactive,tiered@8,tiered@32,greedy   # the trade-off
    python bench/tiers.py --minutes 2 --cells interactive,tiered --json out.json
    python bench/tiers.py --quick                   # smoke run, about a minute

Trace: Azure LLM inference trace 2023 (conversation), CC-BY 4.0 (see ATTRIBUTION), read from
shared/data beside the checkout (``--trace``).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import random
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

import httpx  # noqa: E402
import orjson  # noqa: E402
import trio  # noqa: E402
from _procs import free_port, host_ticks  # noqa: E402
from steplog import percentile, summarize_all  # noqa: E402

from cli.localmesh import AgentProcess, LocalMesh, wait_until  # noqa: E402

TRACE = REPO.parent / "shared" / "data" / "azure-llm-2023-conv.csv"
ATTRIBUTION = (
    "Trace: Azure LLM inference trace 2023 (conversation), CC-BY 4.0. Patel, Choukse, Zhang, "
    'Shah, Goiri, Maleki, Bianchini. "Splitwise: Efficient generative LLM inference using '
    'phase splitting", ISCA 2024.'
)
MODEL = "sim-8b"
CHAT = "/v1/chat/completions"
CELLS = ("interactive", "tiered", "greedy", "batch-only")
VOCAB = [f"w{i}" for i in range(4000)]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- workload ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    at_s: float  # trace seconds from the slice's start
    prompt: int
    output: int


def load_trace(path: Path, start_min: float, minutes: float) -> list[Request]:
    out: list[Request] = []
    t0: datetime | None = None
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            stamp = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
            t0 = t0 or stamp
            t = (stamp - t0).total_seconds() - start_min * 60
            if t < 0:
                continue
            if t >= minutes * 60:
                break
            out.append(
                Request(t, max(1, int(row["ContextTokens"])), max(1, int(row["GeneratedTokens"])))
            )
    return out


def prompt_words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def batch_lines(trace: list[Request], n: int, max_prompt: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        shape = rng.choice(trace)
        lines.append(
            {
                "custom_id": f"b-{i}",
                "method": "POST",
                "url": CHAT,
                "body": {
                    "model": MODEL,
                    "messages": [
                        {
                            "role": "user",
                            "content": prompt_words(min(shape.prompt, max_prompt), rng),
                        }
                    ],
                    "max_tokens": shape.output,
                },
            }
        )
    return lines


# -- the mesh ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    nodes: int
    gpu: str
    pace: float
    kv_tokens: int
    batch_concurrency: int
    priority: bool  # the engines schedule by priority (--scheduling-policy priority)
    ingress_args: tuple[str, ...] = ()  # e.g. the batch tier's flags
    chunk_tokens: int = 0  # >0: the engines chunk prefills at this many tokens per step
    step_log: Path | None = None  # each engine's step log: <this>-n<i>.jsonl (``steplog``)


def step_log(prefix: Path, node: int) -> Path:
    return prefix.with_name(f"{prefix.name}-n{node}.jsonl")


def engine_args(s: Settings, port: int, step_log: Path | None = None) -> list[str]:
    args = [
        "--sim-gpu", s.gpu, "--batch-concurrency", "0",
        "--engine-url", f"http://127.0.0.1:{port}", "--",
        sys.executable, "-m", "fabricnode.simengine", "--model", MODEL, "--port", str(port),
        "--gpu", s.gpu, "--params-b", "8", "--speed", f"{s.pace:g}",
        "--kv-tokens", str(s.kv_tokens),
    ]  # fmt: skip
    if s.priority:
        args += ["--scheduling-policy", "priority"]
    if s.chunk_tokens:
        args += ["--enable-chunked-prefill", "--max-num-batched-tokens", str(s.chunk_tokens)]
    if step_log is not None:
        args += ["--step-log", str(step_log)]
    return args


def engine_supports_priority() -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "fabricnode.simengine", "--help"], capture_output=True, text=True
    )
    return "--scheduling-policy" in out.stdout


def start_mesh(mesh: LocalMesh, s: Settings, worker: bool) -> AgentProcess:
    concurrency = str(s.batch_concurrency if worker else 0)
    # A 20,000-line file of trace-sized prompts is ~100 MB: over the default body limit.
    args = ["--batch-concurrency", concurrency, "--max-body-mb", "512", *s.ingress_args]
    ingress = mesh.start("ingress", args=args, wait=False)
    nodes = [
        mesh.start(
            f"n{i}",
            args=engine_args(s, free_port(), s.step_log and step_log(s.step_log, i)),
            wait=False,
        )
        for i in range(s.nodes)
    ]
    for agent in (ingress, *nodes):
        agent.wait_ready(60)

    def routed() -> bool:
        try:
            data = httpx.get(ingress.http_url + "/v1/models", timeout=2).json()["data"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return any(m["id"] == MODEL and m["fabric_nodes"] == s.nodes for m in data)

    if not wait_until(routed, 60, interval_s=0.1):
        raise RuntimeError("the ingress does not route to every node")
    return ingress


# -- drivers -------------------------------------------------------------------------------------


@dataclass
class Record:
    sent_s: float
    ttft_s: float | None
    e2e_s: float
    tokens: int
    error: str


async def interactive_request(http: httpx.AsyncClient, url: str, body: bytes, t0: float) -> Record:
    start = trio.current_time() - t0
    ttft: float | None = None
    tokens = 0
    error = "stream ended without [DONE]"
    try:
        async with http.stream(
            "POST", url, content=body, headers={"content-type": "application/json"}
        ) as r:
            if r.status_code != 200:
                error = f"status {r.status_code}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        error = ""
                        break
                    if ttft is None and _has_text(line[6:]):
                        ttft = trio.current_time() - t0 - start
                    tokens += 1
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"[:120]
    return Record(start, ttft, trio.current_time() - t0 - start, tokens, error)


def _has_text(data: str) -> bool:
    """A chunk that carries answer text (vLLM's first chunk has only the role)."""
    for choice in orjson.loads(data).get("choices") or ():
        if (choice.get("delta") or {}).get("content"):
            return True
    return False


async def replay(
    http: httpx.AsyncClient, url: str, trace: list[Request], pace: float, t0: float, seed: int,
    records: list[Record],
) -> None:  # fmt: skip
    rng = random.Random(seed)
    bodies = [
        orjson.dumps(
            {"model": MODEL, "stream": True, "max_tokens": r.output,
             "messages": [{"role": "user", "content": prompt_words(r.prompt, rng)}]}
        )
        for r in trace
    ]  # fmt: skip

    async def one(body: bytes) -> None:
        records.append(await interactive_request(http, url, body, t0))

    async with trio.open_nursery() as nursery:
        for req, body in zip(trace, bodies, strict=True):
            delay = t0 + req.at_s / pace - trio.current_time()
            if delay > 0:
                await trio.sleep(delay)
            nursery.start_soon(one, body)


async def greedy_clients(
    http: httpx.AsyncClient, url: str, lines: list[dict[str, Any]], concurrency: int, t0: float,
    done: list[tuple[float, int]],
) -> None:  # fmt: skip
    queue = iter(lines)

    async def client() -> None:
        for line in queue:
            try:
                r = await http.post(url, content=orjson.dumps(line["body"]),
                                    headers={"content-type": "application/json"})  # fmt: skip
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                tokens = r.json().get("usage", {}).get("completion_tokens", 0)
                done.append((trio.current_time() - t0, tokens))

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)


@dataclass
class BatchProgress:
    samples: list[tuple[float, int]] = field(default_factory=list)  # (time, completed)


async def submit_batch(http: httpx.AsyncClient, base: str, lines: list[dict[str, Any]]) -> str:
    data = b"".join(orjson.dumps(line) + b"\n" for line in lines)
    r = await http.post(base + "/v1/files", files={"file": ("batch.jsonl", io.BytesIO(data))},
                        data={"purpose": "batch"})  # fmt: skip
    r.raise_for_status()
    r = await http.post(
        base + "/v1/batches",
        json={"input_file_id": r.json()["id"], "endpoint": CHAT, "completion_window": "24h"},
    )
    r.raise_for_status()
    return str(r.json()["id"])


async def watch_batch(
    http: httpx.AsyncClient, base: str, batch_id: str, t0: float, progress: BatchProgress
) -> None:
    while True:
        r = await http.get(f"{base}/v1/batches/{batch_id}")
        counts = r.json().get("request_counts") or {}
        progress.samples.append((trio.current_time() - t0, int(counts.get("completed", 0))))
        await trio.sleep(1.0)


# -- one cell ------------------------------------------------------------------------------------


@dataclass
class CellResult:
    cell: str
    interactive: int
    errors: int
    ttft_p50_s: float
    ttft_p95_s: float
    e2e_p95_s: float
    batch_lines_per_s: float
    batch_tokens_per_s: float
    window_s: float
    host_busy: float  # share of the host's CPU time busy over the window (2 cores here)


def _busy(cpu: list[tuple[int, int]]) -> float:
    if len(cpu) < 2:
        return float("nan")
    (b0, t0), (b1, t1) = cpu[0], cpu[-1]
    return (b1 - b0) / (t1 - t0) if t1 > t0 else float("nan")


def rate_between(samples: list[tuple[float, int]], lo: float, hi: float) -> float:
    """Completions per second between the samples nearest ``lo`` and ``hi``."""
    inside = [(t, n) for t, n in samples if lo <= t <= hi]
    if len(inside) < 2:
        return float("nan")
    (ta, na), (tb, nb) = inside[0], inside[-1]
    return (nb - na) / (tb - ta) if tb > ta else float("nan")


def log_ingress_state(base: str, cell: str) -> None:
    """What the ingress learned and did, from its /metrics: each node's prefill rate, and how
    many batch requests it took back from nodes under pressure."""
    try:
        text = httpx.get(base + "/metrics", timeout=5).text
    except httpx.HTTPError as exc:
        log(f"{cell}: ingress /metrics unreadable: {exc}")
        return
    wanted = (
        "fabric_ingress_prefill_rate_tokens_per_second{",
        "fabric_ingress_batch_preempted_total",
    )
    for line in text.splitlines():
        if line.startswith(wanted):
            log(f"{cell}: {line}")


def run_cell(
    cell: str,
    trace: list[Request],
    lines: list[dict[str, Any]],
    s: Settings,
    args: argparse.Namespace,
    workdir: Path,
) -> CellResult:
    # tiered@16: the batch tier's per-node cap for this cell; tiered@16/3000: and its pacing;
    # tiered@16+kv0.75: and its KV threshold
    kind, _, knobs = cell.partition("@")
    knobs, _, kv = knobs.partition("+kv")
    cap, _, rate = knobs.partition("/")
    if cap:
        s = replace(s, ingress_args=(*s.ingress_args, "--batch-max-inflight-per-node", cap))
    if rate:
        s = replace(s, ingress_args=(*s.ingress_args, "--batch-prefill-rate", rate))
    if kv:
        s = replace(s, ingress_args=(*s.ingress_args, "--batch-kv-threshold", kv))
    if args.step_log is not None:
        args.step_log.mkdir(parents=True, exist_ok=True)
        s = replace(s, step_log=args.step_log / cell.replace("/", "_"))
    mesh = LocalMesh(workdir / cell)
    try:
        ingress = start_mesh(mesh, s, worker=kind in ("tiered", "batch-only"))
        base = ingress.http_url
        span_s = (trace[-1].at_s / s.pace) if trace else args.minutes * 60 / s.pace
        if kind == "batch-only":
            span_s = args.batch_only_s
        lo, hi = args.warmup_s, span_s
        records: list[Record] = []
        progress = BatchProgress()
        greedy_done: list[tuple[float, int]] = []
        cpu: list[tuple[int, int]] = []  # host (busy, total) ticks at the window's ends
        log(
            f"{cell}: {len(trace) if kind != 'batch-only' else 0} interactive requests "
            f"over {span_s:.0f} s"
        )

        async def main() -> None:
            limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
            async with httpx.AsyncClient(timeout=600, limits=limits) as http:
                t0 = trio.current_time()

                async def sample_cpu() -> None:
                    await trio.sleep(lo)
                    cpu.append(host_ticks())
                    await trio.sleep(max(0.0, hi - lo))
                    cpu.append(host_ticks())

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(sample_cpu)
                    if kind in ("tiered", "batch-only"):
                        batch_id = await submit_batch(http, base, lines)
                        nursery.start_soon(watch_batch, http, base, batch_id, t0, progress)
                    if kind == "greedy":
                        nursery.start_soon(
                            greedy_clients,
                            http,
                            base + CHAT,
                            lines,
                            s.batch_concurrency,
                            t0,
                            greedy_done,
                        )
                    if kind != "batch-only":
                        await replay(http, base + CHAT, trace, s.pace, t0, args.seed, records)
                    else:
                        await trio.sleep(span_s)
                    nursery.cancel_scope.cancel()

        trio.run(main)
        log_ingress_state(base, cell)
        if s.step_log is not None:
            paths = [step_log(s.step_log, i) for i in range(s.nodes)]
            for line in summarize_all(paths, skip_s=lo):
                log(f"{cell}: {line}")
        window = [r for r in records if lo <= r.sent_s <= hi]
        ok = [r for r in window if not r.error]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        if kind == "greedy":
            inside = [(t, n) for t, n in greedy_done if lo <= t <= hi]
            lines_per_s = len(inside) / (hi - lo)
            tokens_per_s = sum(n for _, n in inside) / (hi - lo)
        elif kind in ("tiered", "batch-only"):
            lines_per_s = rate_between(progress.samples, lo, hi)
            mean_out = sum(line["body"]["max_tokens"] for line in lines) / len(lines)
            tokens_per_s = lines_per_s * mean_out
        else:
            lines_per_s = tokens_per_s = 0.0
        return CellResult(
            cell, len(window), len(window) - len(ok),
            percentile(ttfts, 0.5), percentile(ttfts, 0.95),
            percentile([r.e2e_s for r in ok], 0.95), lines_per_s, tokens_per_s, hi - lo,
            _busy(cpu),
        )  # fmt: skip
    finally:
        mesh.close()


# -- report --------------------------------------------------------------------------------------


def table(results: list[CellResult]) -> str:
    head = (
        f"{'cell':<12} {'int.req':>7} {'err':>4} {'TTFT p50':>9} {'TTFT p95':>9} "
        f"{'E2E p95':>8} {'batch/s':>8} {'batch tok/s':>11} {'cpu%':>5}"
    )
    rows = [head]
    for r in results:
        rows.append(
            f"{r.cell:<12} {r.interactive:>7} {r.errors:>4} {r.ttft_p50_s:>9.3f} "
            f"{r.ttft_p95_s:>9.3f} {r.e2e_p95_s:>8.2f} {r.batch_lines_per_s:>8.2f} "
            f"{r.batch_tokens_per_s:>11.0f} {100 * r.host_busy:>5.0f}"
        )
    return "\n".join(rows)


def targets(results: list[CellResult]) -> list[str]:
    by = {r.cell: r for r in results}
    out = []
    alone, greedy = by.get("interactive"), by.get("greedy")
    for r in results:
        if not r.cell.startswith("tiered"):
            continue
        if alone is not None:
            ratio = r.ttft_p95_s / alone.ttft_p95_s
            out.append(f"{r.cell}: interactive TTFT p95 with the batch / without: {ratio:.3f} "
                       f"(target <= 1.1): {'met' if ratio <= 1.1 else 'MISSED'}")  # fmt: skip
        if greedy is not None:
            share = r.batch_lines_per_s / greedy.batch_lines_per_s
            out.append(f"{r.cell}: batch throughput / greedy's (the idle capacity): {share:.2%} "
                       f"(target >= 70%): {'met' if share >= 0.7 else 'MISSED'}")  # fmt: skip
    if greedy is not None and alone is not None:
        ratio = greedy.ttft_p95_s / alone.ttft_p95_s
        out.append(f"for comparison, greedy TTFT p95 / interactive alone: {ratio:.2f}")
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--start-minute", type=float, default=0.0)
    p.add_argument("--minutes", type=float, default=4.0, help="trace minutes replayed (4)")
    p.add_argument(
        "--pace",
        type=float,
        default=1.0,
        help="trace seconds per second; the engines run this much faster (1)",
    )
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpu", default="A100-40G")
    p.add_argument("--kv-tokens", type=int, default=60000)
    p.add_argument(
        "--chunked-prefill",
        type=int,
        default=0,
        metavar="TOKENS",
        help="the engines chunk prefills at TOKENS per step, as vLLM's v1 engine does (2048: "
        "its default for the API server on an A100); 0: a prompt in one step (default)",
    )
    p.add_argument("--batch-lines", type=int, default=20000)
    p.add_argument("--batch-concurrency", type=int, default=64)
    p.add_argument("--max-batch-prompt", type=int, default=4096)
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument("--batch-only-s", type=float, default=90.0)
    p.add_argument("--cells", default="interactive,tiered,greedy")
    p.add_argument(
        "--no-priority", action="store_true", help="engines schedule first come first served"
    )
    p.add_argument(
        "--ingress-args",
        default="",
        help="more `fabric start` flags for the ingress, e.g. '--batch-max-inflight-per-node 16'",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--step-log",
        type=Path,
        metavar="DIR",
        help="each engine writes its step log here (CELL-nI.jsonl); a summary of where "
        "requests waited is printed after each cell (bench/steplog.py)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="30 s of trace, 5 s warm-up, 2,000 batch lines (flags given beside it still win)",
    )
    args = p.parse_args(argv)
    if args.quick:  # other defaults, not other values: --quick --minutes 0.25 replays 15 s
        p.set_defaults(minutes=0.5, warmup_s=5.0, batch_lines=2000, batch_only_s=20.0)
        args = p.parse_args(argv)
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    unknown = [c for c in cells if c.partition("@")[0] not in CELLS]
    if unknown:
        log(f"unknown cells {unknown}; choose from {', '.join(CELLS)}")
        return 2
    trace = load_trace(args.trace, args.start_minute, args.minutes)
    priority = not args.no_priority and engine_supports_priority()
    s = Settings(
        args.nodes, args.gpu, args.pace, args.kv_tokens, args.batch_concurrency, priority,
        tuple(args.ingress_args.split()), chunk_tokens=args.chunked_prefill,
    )  # fmt: skip
    lines = batch_lines(trace, args.batch_lines, args.max_batch_prompt, args.seed + 1)
    log(f"{len(trace)} trace requests, {len(lines)} batch lines; engines by priority: {priority}")
    results = []
    with tempfile.TemporaryDirectory(prefix="fabric-tiers-") as tmp:
        for cell in cells:
            results.append(run_cell(cell, trace, lines, s, args, Path(tmp)))
            log(table(results[-1:]))
    print(table(results))
    for line in targets(results):
        print(line)
    print(ATTRIBUTION)
    if args.json:
        args.json.write_text(
            json.dumps({"settings": asdict(s), "cells": [asdict(r) for r in results]}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
